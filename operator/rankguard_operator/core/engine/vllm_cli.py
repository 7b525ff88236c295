"""vLLM's `vllm serve` command line as its own parser defines it, read from a recorded snapshot.

`VllmCli` knows every option of one vLLM release (all spellings, hidden aliases included, the
kind, nargs, value type and choices: `rankguard_operator/vllm_snapshots/<version>/cli.json`)
and reads an argv the way vLLM's FlexibleArgumentParser does: `_` and `-` alike in long names,
`--flag=value`, unambiguous prefixes of long flags, `--json-arg.key value`, `-O3`. It reports
each problem as one sentence instead of exiting 2, so the operator can refuse an LLMService
before anything is deployed and `rankguard render --check` can say what vLLM would refuse.

Pure: no I/O (the snapshot is handed in).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass(frozen=True)
class Option:
    dest: str
    spellings: tuple[str, ...]
    kind: str  # value | append | true | false | switch | custom
    nargs: int | str | None
    type: Mapping[str, Any] | None
    choices: tuple[Any, ...] | None

    @property
    def takes_value(self) -> bool:
        return self.nargs != 0

    @property
    def name(self) -> str:
        """The spelling people know: the first long one (`--gpu-memory-utilization`)."""
        longs = [s for s in self.spellings if s.startswith("--") and not s.startswith("--no-")]
        return min(longs, key=len) if longs else self.spellings[0]


@dataclass(frozen=True)
class Word:
    """One argv item read as vLLM would: the option it names and the value attached with `=`."""

    option: Option | None
    key: str  # the normalised flag as written (`--max-model-len`), for messages
    attached: str | None  # the value after `=`, or None
    dotted: bool = False  # `--json-arg.key value`: a piece of a JSON option


def human_readable_int(value: str) -> int:
    # vLLM's argparse_utils.human_readable_int: 1k = 1000, 1K = 1024, decimals only with k/m/g/t
    text = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if m is None:
        return int(text)
    number, suffix = m.groups()
    if suffix in "kmgt":
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    return int(number) << (10 * ("KMGT".index(suffix) + 1))


def _human_readable_int_or_auto(value: str) -> int:
    text = value.strip()
    return -1 if text == "-1" or text.lower() == "auto" else human_readable_int(text)


_CONVERTERS: dict[str, Callable[[str], Any]] = {
    "str": str,
    "int": int,
    "float": float,
    "human_readable_int": human_readable_int,
    "human_readable_int_or_auto": _human_readable_int_or_auto,
    "json": json.loads,
}


def convert(type_doc: Mapping[str, Any] | None, value: str) -> Any:
    """The value vLLM's `type=` callable gives (raises ValueError where vLLM's would refuse).
    `opaque` types (vLLM-internal parsers) are passed through: vLLM alone can judge them."""
    if type_doc is None:
        return value
    name = type_doc["name"]
    if name == "optional":
        return None if value in ("", "None") else convert(type_doc["of"], value)
    if name == "opaque" or name not in _CONVERTERS:  # a vLLM-internal parser: vLLM judges it
        return value
    try:
        return _CONVERTERS[name](value)
    except (ValueError, TypeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(str(e)) from None


_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "human_readable_int": "an integer (1k = 1000, 1K = 1024)",
    "human_readable_int_or_auto": "an integer (1k, 1K) or auto",
    "json": "JSON",
}


class VllmCli:
    """One vLLM release's `vllm serve` options (cli.json of its snapshot)."""

    def __init__(self, cli_doc: Mapping[str, Any], version: str) -> None:
        self.version = version
        self.allow_abbrev = bool(cli_doc.get("allow_abbrev", True))
        self.options: tuple[Option, ...] = tuple(
            Option(
                dest=o["dest"],
                spellings=tuple(o["option_strings"]),
                kind=o["kind"],
                nargs=o["nargs"],
                type=o.get("type"),
                choices=None if o.get("choices") is None else tuple(o["choices"]),
            )
            for o in cli_doc["options"]
        )
        self._by_spelling = {s: o for o in self.options for s in o.spellings}
        self._by_dest = {o.dest: o for o in self.options}
        self._longs = sorted(s for s in self._by_spelling if s.startswith("--"))

    def option(self, dest: str) -> Option | None:
        return self._by_dest.get(dest)

    def spellings(self, dest: str) -> tuple[str, ...]:
        o = self._by_dest.get(dest)
        return () if o is None else o.spellings

    # ----------------------------------------------------------------------------------------
    # reading one item

    @staticmethod
    def looks_like_flag(item: str) -> bool:
        """argparse's test: starts with `-`, is not a negative number, is not a bare `-`, and has
        no space unless an `=` comes first (`"--max-num-seqs 64"` is one word to argparse, and
        it is read as a stray positional, not a flag)."""
        if not item.startswith("-") or item == "-" or _NEGATIVE_NUMBER.match(item):
            return False
        head = item.split("=", 1)[0]
        return " " not in head

    def read(self, item: str) -> Word:
        """The option `item` names (None: vLLM does not know it), normalised as vLLM does."""
        if item.startswith("-O") and item != "-O" and not item.startswith("--"):
            level = item[3:] if item[2:3] == "=" else item[2:]  # -O3, -O=3
            return Word(self._by_spelling.get("--optimization-level"), "-O", level)
        key, eq, value = item.partition("=")
        attached = value if eq else None
        if key.startswith("--"):
            # FlexibleArgumentParser: underscores become dashes up to the first `.`
            base, dot, _rest = key[2:].partition(".")
            key = "--" + base.replace("_", "-")
            if dot:
                return Word(self._by_spelling.get(key), key, attached, dotted=True)
            if key in self._by_spelling:
                return Word(self._by_spelling[key], key, attached)
            if self.allow_abbrev and len(key) > 2:
                matches = {self._by_spelling[s].dest: s for s in self._longs if s.startswith(key)}
                if len(matches) == 1:
                    return Word(self._by_spelling[next(iter(matches.values()))], key, attached)
            return Word(None, key, attached)
        return Word(self._by_spelling.get(key), key, attached)

    def suggest(self, key: str) -> str:
        close = get_close_matches(key, self._longs, n=1, cutoff=0.75)
        return f" (did you mean {close[0]}?)" if close else ""

    # ----------------------------------------------------------------------------------------
    # reading a whole argv

    def check_value(self, option: Option, key: str, value: str) -> str | None:
        """Why vLLM would refuse `value` for `option`, or None."""
        try:
            converted = convert(option.type, value)
        except ValueError:
            kind = _TYPE_WORDS.get(str((option.type or {}).get("name")), "a valid value")
            return f"{key} needs {kind}, got {value!r}"
        if option.choices is not None and converted not in option.choices:
            shown = ", ".join(str(c) for c in option.choices)
            return f"{key} must be one of {shown}; got {value!r}"
        return None

    def walk(self, argv: Sequence[str]) -> tuple[list[tuple[int, Word]], list[str]]:
        """Read `argv` (flags only, no `serve MODEL`) as vLLM would: ([(index, word) for every
        flag], [one sentence per problem]). Values are checked against types and choices."""
        words: list[tuple[int, Word]] = []
        problems: list[str] = []
        i = 0
        while i < len(argv):
            item = argv[i]
            at = f"[{i}] {item!r}"
            if not self.looks_like_flag(item):
                if item.startswith("-") and " " in item:
                    parts = ", ".join(repr(p) for p in item.split())
                    problems.append(
                        f"{at} is one argv item with a space in it: vLLM reads it as one unknown "
                        f"argument and exits; write it as separate items: {parts}"
                    )
                else:
                    problems.append(f"{at} is a value without a flag before it; vLLM would refuse it")
                i += 1
                continue
            word = self.read(item)
            words.append((i, word))
            o = word.option
            if o is None:
                problems.append(f"{at}: vLLM {self.version} has no option {word.key}{self.suggest(word.key)}")
                i += 1
                continue
            if word.dotted:  # `--json-arg.key value`: vLLM folds these into the JSON option
                i += 1 if word.attached is not None else 2
                continue
            if not o.takes_value:
                if word.attached is not None:
                    problems.append(f"{at}: {word.key} takes no value")
                i += 1
                continue
            values: list[str] = []
            if word.attached is not None:
                values.append(word.attached)
                i += 1
            else:
                i += 1
                many = o.nargs in ("+", "*")
                while i < len(argv) and not self.looks_like_flag(argv[i]) and (many or not values):
                    values.append(argv[i])
                    i += 1
                    if o.nargs == "?" and values:
                        break
            if not values and o.nargs not in ("?", "*"):
                problems.append(f"{at}: {word.key} needs a value")
            for v in values:
                why = self.check_value(o, word.key, v)
                if why is not None:
                    problems.append(f"{at}: {why}")
        return words, problems

    def check_serve(self, argv: Sequence[str]) -> list[str]:
        """Problems vLLM would have with a whole `serve MODEL FLAGS…` argv (after `vllm`)."""
        if len(argv) < 2 or argv[0] != "serve" or self.looks_like_flag(argv[1]):
            return ["the command must be `vllm serve MODEL …`"]
        return self.walk(argv[2:])[1]
