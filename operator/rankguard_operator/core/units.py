"""Byte quantities and times: parse what people and the API write, print what printer columns
and status show.

Parsing accepts plain integers, decimal/scientific numbers ("1.5e9"), Kubernetes quantity
suffixes ("80Gi", "512Mi", "80G", "500k") and the spellings people use for GPU memory
("80GiB", "80GB", "80 GiB"). Binary suffixes (Ki, Mi, Gi, Ti, Pi, Ei, also written KiB, MiB,
...) are powers of 1024; decimal ones (k/K, M, G, T, P, E, also kB/KB, MB, GB, ...) are powers
of 1000, as in Kubernetes. Fractional byte counts round UP, as Kubernetes' Quantity.Value()
does, so a parsed limit is never smaller than what was written.

Formatting uses Kubernetes-style binary suffixes with at most one decimal (`1.4Gi`,
`512Mi`, `80Gi`) because that is what `kubectl get` columns and `kubectl top` show.

Times are RFC 3339 in UTC with a Z and whole seconds, as the API server writes metav1.Time
(`iso`); `parse_iso` reads that and any RFC 3339 offset back into epoch seconds.

Pure functions, no I/O.
"""

from __future__ import annotations

import math
import re
from datetime import datetime, timezone
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import Any

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

_BINARY = {"ki": 1, "mi": 2, "gi": 3, "ti": 4, "pi": 5, "ei": 6}
_DECIMAL = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5, "e": 6}
_FORMAT_UNITS = ("Ki", "Mi", "Gi", "Ti", "Pi", "Ei")

# number, optional exponent, optional unit; whitespace between number and unit is allowed
# ("80 GiB") because people paste it from nvidia-smi and vendor spec sheets.
_QUANTITY = re.compile(
    r"^\s*(?P<num>[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$",
)


class QuantityError(ValueError):
    """A byte quantity could not be understood. The message quotes the input and the forms accepted."""


def _unit_factor(unit: str, text: str) -> int:
    if unit == "":
        return 1
    u = unit.lower()
    # "B" alone (and the trailing B of "GiB"/"GB") only says "bytes".
    if u == "b":
        return 1
    if u.endswith("b") and len(u) > 1:
        u = u[:-1]
    if u in _BINARY:
        return int(KiB ** _BINARY[u])
    # Kubernetes' lowercase "m" is milli; for bytes that is never what a person means
    # ("512m" of memory is 0.512 bytes), so reject it rather than silently rounding to 1.
    if unit == "m":
        raise QuantityError(f"{text!r}: 'm' means milli (1/1000) in Kubernetes quantities; write 'M' or 'Mi'")
    if u in _DECIMAL:
        return int(1000 ** _DECIMAL[u])
    raise QuantityError(
        f"{text!r}: unknown unit {unit!r}; use bytes or a suffix such as Ki, Mi, Gi, Ti (1024-based) "
        "or k, M, G, T (1000-based)"
    )


def parse_bytes(value: str | int | float) -> int:
    """Parse a byte quantity into a non-negative integer number of bytes.

    >>> parse_bytes("80GiB"), parse_bytes("80Gi"), parse_bytes("80G"), parse_bytes("1.5e9"), parse_bytes(42)
    (85899345920, 85899345920, 80000000000, 1500000000, 42)
    """
    if isinstance(value, bool):
        # bool is an int in Python; `True` bytes is a bug upstream, not one byte.
        raise QuantityError(f"{value!r}: expected a byte quantity, got a boolean")
    if isinstance(value, int):
        if value < 0:
            raise QuantityError(f"{value}: a byte quantity cannot be negative")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise QuantityError(f"{value!r}: a byte quantity must be a finite, non-negative number")
        return math.ceil(Decimal(repr(value)))
    if not isinstance(value, str):
        raise QuantityError(f"{value!r}: expected a string or a number of bytes")
    m = _QUANTITY.match(value)
    if m is None:
        raise QuantityError(
            f"{value!r}: not a byte quantity; examples: 85899345920, 80Gi, 80GiB, 80G, 1.5e9, 512Mi"
        )
    try:
        number = Decimal(m.group("num"))
    except InvalidOperation as exc:  # the regex should make this unreachable; keep the message clear anyway
        raise QuantityError(f"{value!r}: not a number") from exc
    if number < 0:
        raise QuantityError(f"{value!r}: a byte quantity cannot be negative")
    return math.ceil(number * _unit_factor(m.group("unit"), value))


def format_bytes(n: int) -> str:
    """Human form with a binary suffix and at most one decimal: `1.4Gi`, `512Mi`, `80Gi`, `-200Mi`.

    Values below 1 KiB print as plain bytes (`512`), as Kubernetes prints them. Negative
    values keep their sign: a headroom column must show when a rank is over budget.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"format_bytes expects an int number of bytes, got {type(n).__name__}")
    sign = "-" if n < 0 else ""
    a = abs(n)
    if a < KiB:
        return f"{sign}{a}"
    exp = 0
    while exp < len(_FORMAT_UNITS) and a >= KiB ** (exp + 1):
        exp += 1
    # one decimal, rounded half-up; 1023.96Mi must become 1Gi, not 1024Mi
    scaled = (Decimal(a) / Decimal(KiB**exp)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
    if scaled >= KiB and exp < len(_FORMAT_UNITS):
        exp += 1
        scaled = (Decimal(a) / Decimal(KiB**exp)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP)
    text = f"{scaled:f}"
    if text.endswith(".0"):
        text = text[:-2]
    return f"{sign}{text}{_FORMAT_UNITS[exp - 1]}"


def format_quantity(n: int) -> str:
    """Exact Kubernetes quantity for a byte count (for resource limits): `80Gi` when it divides
    evenly, else the plain integer. Unlike `format_bytes`, nothing is rounded."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise QuantityError(f"{n!r}: expected a non-negative int number of bytes")
    if n == 0:
        return "0"
    for exp in range(len(_FORMAT_UNITS), 0, -1):
        if n % (KiB**exp) == 0:
            return f"{n // KiB**exp}{_FORMAT_UNITS[exp - 1]}"
    return str(n)


# --------------------------------------------------------------------------------------------
# Times


def iso(ts: float) -> str:
    """Epoch seconds -> RFC 3339 in UTC with a Z, whole seconds (the API's metav1.Time form)."""
    return datetime.fromtimestamp(int(ts), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_or_none(ts: float | None) -> str | None:
    """A clock kept in status (None: not running), RFC 3339 as Kubernetes writes times."""
    return None if ts is None else iso(ts)


def parse_iso(text: Any) -> float | None:
    """RFC 3339 (`2026-11-29T21:46:00Z`, as the API writes times) -> epoch seconds, or None."""
    if not isinstance(text, str) or not text:
        return None
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()
