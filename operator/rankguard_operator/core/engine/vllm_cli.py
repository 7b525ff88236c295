"""vLLM's `vllm serve` command line as its own parser defines it, read from a recorded snapshot.

`VllmCli` knows every option of one vLLM release (all spellings, hidden aliases included, the
kind, nargs, value type and choices: `rankguard_operator/vllm_snapshots/<version>/cli.json`)
and reads an argv the way vLLM's FlexibleArgumentParser does: `_` and `-` alike in long names,
`--flag=value`, unambiguous prefixes of long and single-dash flags (the help action counts: `--he`
is ambiguous), `--json-arg.key value`, `-O3` and `-O 3`. The JSON options (a pydantic dataclass
to vLLM) are checked against their recorded schema (core/engine/json_options). It reports each
problem as one sentence instead of exiting 2 or crashing, so the operator can refuse an
LLMService before anything is deployed and `rankguard render --check` can say what vLLM would
refuse. tests/unit/core/engine/test_surface.py holds it against what the real parser did with 1,000+
command lines (tests/fixtures/vllm_argv_cases.json).

(Over 450 lines because it is one reader: an argv is walked once, item by item, and the prefix,
dotted-item, negative-number and JSON-folding rules each change how the next item is read; the
JSON schemas and the value rules it answers to live beside it, in json_options.py and
config_checks.py.)

Pure: no I/O (the snapshot is handed in).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from difflib import get_close_matches
from functools import lru_cache
from typing import Any

from rankguard_operator.core.engine.json_options import check_json_option, expand_human_numbers

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


@dataclass(frozen=True)
class Option:
    dest: str
    spellings: tuple[str, ...]
    kind: str  # value | append | true | false | switch | custom | help
    nargs: int | str | None
    type: Mapping[str, Any] | None
    choices: tuple[Any, ...] | None
    negative: tuple[str, ...] = ()  # a switch's spellings that turn it off (`--no-enable-lora`)
    # the value vLLM's parser gives when the option is not written (not part of the identity: a list)
    default: Any = field(default=None, compare=False)

    def reads(self, value: str) -> Any:
        """The value vLLM's `type=` callable makes of `value` (ValueError where it refuses it)."""
        return convert(self.type, value)

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
    values: tuple[str, ...] = ()  # the values it took (filled by `walk`)
    ambiguous: tuple[str, ...] = ()  # the flags an ambiguous prefix could mean

    @property
    def turns_off(self) -> bool:
        """A switch's negative spelling (`--no-enable-lora`, `--disable-x`): nothing turned on."""
        return self.option is not None and self.key in self.option.negative


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
    "lower": str.lower,  # vLLM's `lambda s: s.lower()` before its choices: AITER is aiter
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


HELP = "help"


class VllmCli:
    """One vLLM release's `vllm serve` options (cli.json of its snapshot, and what its
    surface.json records beyond argparse: the help spellings and the JSON options' schemas)."""

    def __init__(
        self,
        cli_doc: Mapping[str, Any],
        version: str,
        surface: Mapping[str, Any] | None = None,
        kv_connectors: Sequence[str] = (),
    ) -> None:
        self.version = version
        # the KV connectors vLLM's factory registers (engine.json, where the snapshot records them)
        self.kv_connectors: frozenset[str] = frozenset(kv_connectors)
        self.allow_abbrev = bool(cli_doc.get("allow_abbrev", True))
        surface = surface or {}
        # a release whose engine.json lists no connectors: the factory's names surface.json records
        self.kv_connectors = self.kv_connectors or frozenset(surface.get("kv_connectors", ()))
        self.json_options: Mapping[str, Any] = surface.get("json_options", {})
        # what vLLM's config build checks of a value its parser passes (surface.json; a release
        # recorded before these keys has none, and the rules reading them then say nothing)
        self.value_bounds: Mapping[str, Any] = surface.get("value_bounds", {})
        self.value_names: Mapping[str, Any] = surface.get("value_names", {})
        self.dict_options: Mapping[str, Any] = surface.get("dict_options", {})
        helps = tuple(surface.get("help_options", ()))
        self.options: tuple[Option, ...] = tuple(
            Option(
                dest=o["dest"],
                spellings=tuple(o["option_strings"]),
                kind=o["kind"],
                nargs=o["nargs"],
                type=o.get("type"),
                choices=None if o.get("choices") is None else tuple(o["choices"]),
                negative=tuple(o.get("negative_option_strings") or ()),
                default=o.get("default"),
            )
            for o in cli_doc["options"]
        ) + ((Option(HELP, helps, HELP, 0, None, None),) if helps else ())
        self._by_spelling = {s: o for o in self.options for s in o.spellings}
        self._by_dest = {o.dest: o for o in self.options}
        self._longs = sorted(s for s in self._by_spelling if s.startswith("--"))
        self._shorts = sorted(s for s in self._by_spelling if not s.startswith("--"))
        self._walked = lru_cache(maxsize=4096)(self._walk)

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

    def _prefix(self, key: str, attached: str | None, among: list[str]) -> Word:
        """argparse's abbreviation rule: one option whose spelling starts with `key` (several
        spellings of one option are one match); more than one is ambiguous, which vLLM refuses."""
        matches: dict[str, str] = {}
        for s in among:
            if s.startswith(key):
                matches.setdefault(self._by_spelling[s].dest, s)
        if len(matches) == 1:
            return Word(self._by_spelling[next(iter(matches.values()))], key, attached)
        if len(matches) > 1:
            return Word(None, key, attached, ambiguous=tuple(sorted(matches.values())))
        return Word(None, key, attached)

    def read(self, item: str) -> Word:
        """The option `item` names (None: vLLM does not know it), normalised as vLLM does."""
        if item.startswith("-O") and item != "-O" and not item.startswith("--"):
            level = item[3:] if item[2:3] == "=" else item[2:]  # -O3, -O=3
            return Word(self._by_spelling.get("--optimization-level"), "-O", level)
        key, eq, value = item.partition("=")
        attached = value if eq else None
        if key.startswith("--"):
            # FlexibleArgumentParser: underscores become dashes up to the first `.`
            base, dot, rest = key[2:].partition(".")
            key = "--" + base.replace("_", "-")
            if dot:  # the key keeps its path (`--speculative-config.method`): it is folded by it
                return Word(self._by_spelling.get(key), f"{key}.{rest}", attached, dotted=True)
            if key in self._by_spelling:
                return Word(self._by_spelling[key], key, attached)
            if self.allow_abbrev and len(key) > 2:
                return self._prefix(key, attached, self._longs)
            return Word(None, key, attached)
        if "." in key:  # `-cc.mode=3`: a dotted piece of a JSON option's single-dash alias
            return Word(self._by_spelling.get(key.split(".", 1)[0]), key, attached, dotted=True)
        if key in self._by_spelling:
            return Word(self._by_spelling[key], key, attached)
        if self.allow_abbrev:
            # argparse matches a single-dash item as a whole against every spelling (`-t 2` is
            # `-tp 2`; `-tp2` matches nothing)
            return self._prefix(item, None, self._shorts)
        return Word(None, key, attached)

    def _misread_dotted(self, item: str) -> bool:
        """An item FlexibleArgumentParser takes for a dotted JSON option that is none: it starts
        with one '-' and holds a '.' before any '=' (`-0.5`, `-.5`), wherever it stands."""
        if not item.startswith("-") or item.startswith("--") or "." not in item.split("=", 1)[0]:
            return False
        word = self.read(item)
        return word.option is None or not word.dotted

    def suggest(self, key: str) -> str:
        close = get_close_matches(key, self._longs, n=1, cutoff=0.75)
        return f" (did you mean {close[0]}?)" if close else ""

    # ----------------------------------------------------------------------------------------
    # reading a whole argv

    def check_value(self, option: Option, key: str, value: str) -> str | None:
        """Why vLLM would refuse `value` for `option`, or None."""
        entry = self.json_options.get(option.dest)
        if entry is not None:
            if (option.type or {}).get("name") == "optional" and value in ("", "None"):
                return None
            why = check_json_option(entry, value, human_readable_int)
            return None if why is None else f"{key} {why}"
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
        flag, with the values it took], [one sentence per problem]). Values are checked against
        types, choices and (JSON options) their dataclass's schema; dotted pieces of a JSON
        option (`-cc.mode=3`) are folded into one object and checked as vLLM folds them.

        Remembered per argv: every pass parses the spec and resolves the model, and each asks
        about the same extraArgs (the owned flags, the surface, host memory, measure-first);
        one with JSON options costs about 0.1 ms to read."""
        words, problems = self._walked(tuple(argv))
        return list(words), list(problems)

    def _walk(self, argv: tuple[str, ...]) -> tuple[tuple[tuple[int, Word], ...], tuple[str, ...]]:
        # FlexibleArgumentParser reads these before argparse, wherever they stand (a value too)
        misread = frozenset(j for j, item in enumerate(argv) if self._misread_dotted(item))
        words: list[tuple[int, Word]] = []
        problems = [self._misread_problem(j, argv[j]) for j in sorted(misread)]
        i = 0
        while i < len(argv):
            step = self._read_item(argv, i, misread)
            if step.word is not None:
                words.append((i, step.word))
            problems += step.problems
            i = step.end
        problems += self._dotted_problems(words)
        return tuple(words), tuple(problems)

    def _misread_problem(self, j: int, item: str) -> str:
        return (
            f"[{j}] {item!r}: vLLM {self.version} reads an item that starts with '-' and holds a "
            "'.' as a dotted JSON option (`-x.key value`): a negative decimal crashes its parser or "
            "swallows the next item; leave it out or write it without the sign"
        )

    def _read_item(self, argv: tuple[str, ...], i: int, misread: frozenset[int]) -> _Step:
        """argv[i] and the values it takes: the word it is (None: none), its problems, and where
        the next item starts."""
        item = argv[i]
        at = f"[{i}] {item!r}"
        if i in misread:  # said once, before the walk
            return _Step(i + 1)
        if item == "-O" and i + 1 < len(argv) and argv[i + 1] in ("0", "1", "2", "3"):
            level = argv[i + 1]
            optimization = self._by_spelling.get("--optimization-level")
            return _Step(i + 2, Word(optimization, "-O", level, values=(level,)))
        if not self.looks_like_flag(item):
            return _Step(i + 1, problems=(_stray_problem(at, item),))
        word = self.read(item)
        o = word.option
        if o is None:
            return _Step(i + 1, word, (self._unknown_problem(at, word),))
        if word.dotted:  # `--json-arg.key value`: vLLM folds these into the JSON option
            return _read_dotted(argv, i, word, at)
        if not o.takes_value:
            refused = () if word.attached is None else (f"{at}: {word.key} takes no value",)
            return _Step(i + 1, word, refused)
        return self._read_valued(argv, i, word, o, misread)

    def _read_valued(
        self, argv: tuple[str, ...], i: int, word: Word, o: Option, misread: frozenset[int]
    ) -> _Step:
        """A flag that takes values: the values it takes, each checked."""
        at = f"[{i}] {argv[i]!r}"
        values, end = self._values_taken(argv, i, word, o)
        problems = [] if values or o.nargs in ("?", "*") else [f"{at}: {word.key} needs a value"]
        # a misread item taken as a value has had its problem said already
        misread_values = {argv[j] for j in misread if i < j < end}
        for v in values:
            why = None if v in misread_values else self._value_problem(o, word.key, v)
            if why is not None:
                problems.append(f"{at}: {why}")
        return _Step(end, replace(word, values=tuple(values)), tuple(problems))

    def _unknown_problem(self, at: str, word: Word) -> str:
        if word.ambiguous:
            return (
                f"{at}: {word.key} is ambiguous to vLLM {self.version} (it could be "
                f"{', '.join(word.ambiguous)}); write the whole flag"
            )
        return f"{at}: vLLM {self.version} has no option {word.key}{self.suggest(word.key)}"

    def _values_taken(self, argv: tuple[str, ...], i: int, word: Word, o: Option) -> tuple[list[str], int]:
        """The values the flag at argv[i] takes, as argparse's nargs has it, and the index after them."""
        if word.attached is not None:
            return [word.attached], i + 1
        values: list[str] = []
        j = i + 1
        many = o.nargs in ("+", "*")
        while j < len(argv) and not self.looks_like_flag(argv[j]) and (many or not values):
            values.append(argv[j])
            j += 1
            if o.nargs == "?":
                break
        return values, j

    def _value_problem(self, o: Option, key: str, value: str) -> str | None:
        why = self.check_value(o, key, value)
        if why is None and many_optional(o) and value in ("", "None"):
            return f"{key} reads {value!r} as null inside its list, which vLLM's config refuses"
        return why

    def _dotted_problems(self, words: Sequence[tuple[int, Word]]) -> list[str]:
        """The dotted pieces of each JSON option folded into one object, checked as vLLM checks it
        (named at the first piece)."""
        dotted: dict[str, tuple[int, Option, dict[str, Any]]] = {}
        for at, word in words:
            if word.dotted and word.option is not None:
                merged = dotted.setdefault(word.option.dest, (at, word.option, {}))[2]
                _fold(merged, word.key, word.values[0])
        problems = []
        for first, o, merged in dotted.values():
            why = self.check_value(o, o.name, json.dumps(merged))
            if why is not None:
                problems.append(f"[{first}] {o.name} (from its dotted items): {why}")
        return problems

    def json_object(self, argv: Sequence[str], dest: str) -> dict[str, Any] | None:
        """The object a JSON option (`--kv-transfer-config`, `-cc`, …) holds after vLLM reads `argv`
        (flags only): FlexibleArgumentParser folds the dotted items (`-cc.mode=3`) into one object
        and appends it after every other item, so dotted items win over a whole value; otherwise
        the last whole value (argparse keeps the last), `4k`-style numbers expanded. None: the
        option is not given, or its value is not a JSON object (the reader reports that)."""
        whole: dict[str, Any] | None = None
        dotted: dict[str, Any] | None = None
        for _, word in self.walk(argv)[0]:
            if word.option is None or word.option.dest != dest or not word.values:
                continue
            if word.dotted:
                dotted = {} if dotted is None else dotted
                _fold(dotted, word.key, word.values[0])
                continue
            try:
                value = json.loads(expand_human_numbers(word.values[-1], human_readable_int))
            except ValueError:
                value = None
            whole = value if isinstance(value, dict) else None
        return dotted if dotted is not None else whole

    def check_serve(self, argv: Sequence[str]) -> list[str]:
        """Problems vLLM would have with a whole `serve MODEL FLAGS…` argv (after `vllm`)."""
        if len(argv) < 2 or argv[0] != "serve" or self.looks_like_flag(argv[1]):
            return ["the command must be `vllm serve MODEL …`"]
        return self.walk(argv[2:])[1]


def many_optional(o: Option) -> bool:
    """A list option whose items are optional (`None` is null to vLLM)."""
    return o.nargs in ("+", "*") and (o.type or {}).get("name") == "optional"


@dataclass(frozen=True)
class _Step:
    """One argv item read: where the next item starts, the word it is (None: none), its problems."""

    end: int
    word: Word | None = None
    problems: tuple[str, ...] = ()


def _stray_problem(at: str, item: str) -> str:
    """An item where a flag should stand that is none (`"--max-num-seqs 64"` as one item is one)."""
    if item.startswith("-") and " " in item:
        parts = ", ".join(repr(p) for p in item.split())
        return (
            f"{at} is one argv item with a space in it: vLLM reads it as one unknown "
            f"argument and exits; write it as separate items: {parts}"
        )
    return f"{at} is a value without a flag before it; vLLM would refuse it"


def _read_dotted(argv: Sequence[str], i: int, word: Word, at: str) -> _Step:
    """`--json-arg.key value` (or `=value`): one piece of a JSON option, folded at the end."""
    text = word.attached
    if text is None and i + 1 < len(argv):
        text = argv[i + 1]
    end = i + 1 if word.attached is not None else i + 2
    if text is None:
        return _Step(end, problems=(f"{at}: {word.key} needs a value",))
    return _Step(end, replace(word, values=(text,)))


def _fold(merged: dict[str, Any], key: str, text: str) -> None:
    """One `--json-arg.a.b value` item into its option's object, as FlexibleArgumentParser does:
    the value as JSON, else a human-readable integer, else the string; `key+` splits a list."""
    path = key.split(".")[1:]
    if path and path[-1].endswith("+"):
        path[-1] = path[-1][:-1]
        value: Any = text.split(",")
    else:
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = human_readable_int(text)
            except ValueError:
                value = text
    node = merged
    for k in path[:-1]:
        nxt = node.get(k)
        node = node.setdefault(k, {}) if not isinstance(nxt, dict) else nxt
    if path:
        node[path[-1]] = value
