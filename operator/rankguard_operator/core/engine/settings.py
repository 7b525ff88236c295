"""One extraArgs option as the argv sets it, and whether it asks for anything (vLLM's reading).

Shared by the surface's rulings (surface.py) and the checks vLLM makes when it builds its config
(config_checks.py). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rankguard_operator.core.engine.vllm_cli import Option, Word


@dataclass(frozen=True)
class Setting:
    """One option as the argv sets it: where, how it was written, and its last value."""

    at: int
    key: str
    value: str | None  # None: a switch (or a flag with no value)
    on: bool  # False for a switch's negative spelling
    option: Option | None = None


def settings(words: Sequence[tuple[int, Word]]) -> dict[str, Setting]:
    """dest -> the last setting of it in the argv (argparse keeps the last). A dotted piece of a
    JSON option (`--speculative-config.method ngram`) sets that option like the whole object."""
    out: dict[str, Setting] = {}
    for i, w in words:
        o = w.option
        if o is None:
            continue
        value = w.values[-1] if w.values else w.attached
        out[o.dest] = Setting(i, w.key, value, not w.turns_off, o)
    return out


def int_value(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


def float_value(value: str | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:
        return None


def turned_on(s: Setting) -> bool:
    """Whether the setting asks for something, judged as vLLM reads the value: a switch on, or a
    value other than the option's default. Only what vLLM's own type makes null (`None` or an
    empty value of an optional option) or the default itself is "not set": `--uds 0` is a unix
    socket named 0, `--ssl-keyfile none` a key file named none, `--data-parallel-size-local=0`
    zero local engines."""
    if not s.on:
        return False
    if s.value is None or s.option is None:
        return True
    try:
        value = s.option.reads(s.value)
    except ValueError:
        return True  # a value vLLM refuses: the reader says so
    if value is None:
        return False
    if s.option.nargs in ("+", "*"):
        return True  # a list: any item asks for something
    return bool(value != s.option.default)
