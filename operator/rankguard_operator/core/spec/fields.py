"""Reading one field of an LLMService spec: type, range and choices checked, defaults applied,
and every failure a `SpecError` that names the field (`spec.engine.maxNumSeqs must be ...`).

Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from rankguard_operator.core.units import QuantityError, parse_bytes


class SpecError(ValueError):
    """The LLMService spec cannot be served as written. The message names the field and the fix."""


def section(doc: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any]:
    v = doc.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise SpecError(f"{where}.{key} must be an object, got {type(v).__name__}")
    return v


def int_field(
    doc: Mapping[str, Any], key: str, where: str, default: int | None, *, lo: int, hi: int | None = None
) -> int | None:
    v = doc.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(f"{where}.{key} must be an integer, got {v!r:.60}")
    if v < lo or (hi is not None and v > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise SpecError(f"{where}.{key} must be {bound}, got {v}")
    return v


def required_int(
    doc: Mapping[str, Any], key: str, where: str, default: int, *, lo: int, hi: int | None = None
) -> int:
    v = int_field(doc, key, where, default, lo=lo, hi=hi)
    assert v is not None  # a default was given
    return v


def bool_field(doc: Mapping[str, Any], key: str, where: str, default: bool) -> bool:
    v = doc.get(key, default)
    if not isinstance(v, bool):
        raise SpecError(f"{where}.{key} must be true or false, got {v!r:.60}")
    return v


def number_field(
    doc: Mapping[str, Any], key: str, where: str, default: float | None, *, lo: float, hi: float
) -> float | None:
    v = doc.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SpecError(f"{where}.{key} must be a number, got {v!r:.60}")
    if not lo <= v <= hi:
        raise SpecError(f"{where}.{key} must be between {lo:g} and {hi:g}, got {v:g}")
    return float(v)


def str_field(
    doc: Mapping[str, Any], key: str, where: str, default: str | None, *, max_len: int = 1024
) -> str | None:
    v = doc.get(key, default)
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise SpecError(f"{where}.{key} must be a non-empty string, got {v!r:.60}")
    if len(v) > max_len:
        raise SpecError(f"{where}.{key} is longer than {max_len} characters")
    return v


def choice_field(doc: Mapping[str, Any], key: str, where: str, default: str, choices: tuple[str, ...]) -> str:
    v = doc.get(key, default)
    if v not in choices:
        raise SpecError(f"{where}.{key} must be one of {', '.join(choices)}, got {v!r:.60}")
    assert isinstance(v, str)
    return v


def memory_quantity(doc: Mapping[str, Any], key: str, where: str) -> int | None:
    v = doc.get(key)
    if v is None:
        return None
    try:
        n = parse_bytes(v)
    except QuantityError as exc:
        raise SpecError(f"{where}.{key}: {exc}") from None
    if n < 1:
        raise SpecError(f"{where}.{key} must be a positive quantity, got {v!r}")
    return n


def cpu_quantity(doc: Mapping[str, Any], key: str, where: str) -> str | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise SpecError(f"{where}.{key} must be a CPU quantity such as 8 or 500m, got {v!r:.60}")
    text = str(v).strip()
    if not text:
        raise SpecError(f"{where}.{key} must be a CPU quantity such as 8 or 500m")
    return text
