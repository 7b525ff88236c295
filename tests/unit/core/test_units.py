"""Byte quantities: what people type in, what printer columns show."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_operator.core.units import (
    GiB,
    KiB,
    MiB,
    QuantityError,
    format_bytes,
    format_quantity,
    parse_bytes,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * GiB),
        ("80Gi", 80 * GiB),
        ("80 GiB", 80 * GiB),
        ("80gib", 80 * GiB),
        ("80G", 80_000_000_000),
        ("80GB", 80_000_000_000),
        ("1.5e9", 1_500_000_000),
        ("1.5E9", 1_500_000_000),
        ("85899345920", 85_899_345_920),
        ("512Mi", 512 * MiB),
        ("512MiB", 512 * MiB),
        ("1.5Ki", 1536),
        ("500k", 500_000),
        ("500K", 500_000),
        ("2Ti", 2 << 40),
        ("1Pi", 1 << 50),
        ("0", 0),
        ("0.5", 1),  # fractional bytes round up, as Kubernetes' Quantity.Value() does
        ("1.0000001Ki", 1025),
        ("  64Gi  ", 64 * GiB),
        ("10B", 10),
        (42, 42),
        (1.5e9, 1_500_000_000),
        (2.5, 3),
    ],
)
def test_parse_bytes(text: str | int | float, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("bad", "fragment"),
    [
        ("", "not a byte quantity"),
        ("abc", "not a byte quantity"),
        ("80Gx", "unknown unit"),
        ("-1Gi", "cannot be negative"),
        ("512m", "milli"),
        ("1.2.3Gi", "not a byte quantity"),
        (-5, "cannot be negative"),
        (True, "boolean"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (None, "expected a string"),
    ],
)
def test_parse_bytes_rejects(bad: object, fragment: str) -> None:
    with pytest.raises(QuantityError, match=fragment):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_quantity_error_is_a_value_error() -> None:
    # callers that only know ValueError (argparse type functions, kopf handlers) still catch it
    with pytest.raises(ValueError, match="80Gx"):
        parse_bytes("80Gx")


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0"),
        (512, "512"),
        (1023, "1023"),
        (1024, "1Ki"),
        (1536, "1.5Ki"),
        (512 * MiB, "512Mi"),
        (80 * GiB, "80Gi"),
        (int(1.4 * GiB), "1.4Gi"),
        (int(1.25 * GiB), "1.3Gi"),  # half-up at one decimal
        (int(1023.96 * MiB), "1Gi"),  # never "1024Mi"
        (57_458_688, "54.8Mi"),  # the article's rank-0 extra at TP8, batch 128
        (-200 * MiB, "-200Mi"),
        (-int(1.4 * GiB), "-1.4Gi"),
        (3 << 40, "3Ti"),
    ],
)
def test_format_bytes(n: int, text: str) -> None:
    assert format_bytes(n) == text


def test_format_bytes_rejects_non_int() -> None:
    with pytest.raises(TypeError):
        format_bytes(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0"), (80 * GiB, "80Gi"), (512 * MiB, "512Mi"), (1536, "1536"), (3 * KiB, "3Ki"), (1, "1")],
)
def test_format_quantity_is_exact(n: int, text: str) -> None:
    assert format_quantity(n) == text
    assert parse_bytes(text) == n


@given(st.integers(min_value=0, max_value=1 << 60))
def test_format_quantity_round_trips(n: int) -> None:
    assert parse_bytes(format_quantity(n)) == n


@given(st.integers(min_value=KiB, max_value=1 << 55))
def test_format_bytes_is_within_half_a_tenth_of_its_unit(n: int) -> None:
    text = format_bytes(n)
    unit = next(KiB**e for e, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi"), start=1) if text.endswith(s))
    assert abs(parse_bytes(text) - n) <= 0.05 * unit + 1
    number = text[:-2]
    assert len(number.partition(".")[2]) <= 1  # at most one decimal
