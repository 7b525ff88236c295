"""Sizes as the engines print them, for the recogniser tests."""

from __future__ import annotations

from rankguard_agent.wire.recognisers import GIB


def g(x: float) -> int:
    """`x` GiB in bytes, as a 2-decimal GiB figure reads back."""
    return round(x * GIB)


def pytorch_format(size: int) -> str:
    """Sizes as the caching allocator prints them: bytes up to 1 KiB, then 2-decimal binary units."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1 << 20:
        return f"{size / 1024:.2f} KiB"
    if size <= 1 << 30:
        return f"{size / (1 << 20):.2f} MiB"
    return f"{size / (1 << 30):.2f} GiB"
