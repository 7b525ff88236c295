"""Which status writes wait (core/status/hold): figures that only drifted, for a while."""

from __future__ import annotations

from typing import Any

from rankguard_operator.core.status.hold import HOLD_SECONDS, hold, only_drift
from rankguard_operator.core.status.patch import status_patch
from rankguard_operator.core.units import format_bytes

GIB = 1 << 30
TOTAL = 80 * GIB
PCT = TOTAL // 100


def row(rank: int, min_free: int, *, stale: bool = False) -> dict[str, Any]:
    return {
        "rank": rank,
        "uuid": f"GPU-{rank}",
        "pod": "llama-0",
        "stage": 0,
        "totalBytes": TOTAL,
        "freeBytes": min_free + GIB,
        "minFreeBytes": min_free,
        "headroomBytes": min_free,
        "headroom": format_bytes(min_free),
        "stale": stale,
    }


def status(*min_free: int, phase: str = "Running", stale: bool = False) -> dict[str, Any]:
    rows = [row(r, m, stale=stale) for r, m in enumerate(min_free)]
    low = min(range(len(min_free)), key=lambda r: min_free[r])
    return {
        "phase": phase,
        "ranks": rows,
        "perRank": [f"rank {r['rank']}: headroom {r['headroom']}" for r in rows],
        "minHeadroom": format_bytes(min_free[low]),
        "bottleneckRank": low,
    }


def patch_of(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    patch = status_patch(old, new)
    assert patch is not None
    return patch


def test_drift_within_a_percent_is_held_even_when_the_bottleneck_rank_flips() -> None:
    old = status(10 * GIB, 10 * GIB + PCT // 2)
    new = status(10 * GIB + PCT, 10 * GIB + PCT // 4)  # rank 1 is now the tighter one
    patch = patch_of(old, new)
    assert "bottleneckRank" in patch and only_drift(old, patch)
    assert hold(old, patch, since_write=1.0)


def test_a_move_beyond_a_percent_is_written() -> None:
    old = status(10 * GIB, 12 * GIB)
    assert not only_drift(old, patch_of(old, status(10 * GIB - PCT - 1, 12 * GIB)))


def test_a_small_move_across_a_policy_line_is_written() -> None:
    line = 10 * GIB
    old, new = status(line, 12 * GIB), status(line - 1, 12 * GIB)
    assert only_drift(old, patch_of(old, new))
    assert not only_drift(old, patch_of(old, new), lines=(line, 2 * line))


def test_anything_but_figures_is_written_with_them() -> None:
    old = status(10 * GIB)
    assert not only_drift(old, patch_of(old, status(10 * GIB + 1, phase="Degraded")))
    assert not only_drift(old, patch_of(old, status(10 * GIB + 1, stale=True)))
    assert not only_drift(old, patch_of(old, status(10 * GIB, 10 * GIB)))  # a rank more
    assert not only_drift(old, {"perRank": ["rank 0: headroom ?"]})  # text without its figures
    assert not only_drift({}, patch_of({}, old))  # the first figures


def test_held_only_while_the_last_write_is_recent_and_known() -> None:
    old = status(10 * GIB)
    patch = patch_of(old, status(10 * GIB + 1))
    assert hold(old, patch, since_write=HOLD_SECONDS - 1)
    assert not hold(old, patch, since_write=HOLD_SECONDS)
    assert not hold(old, patch, since_write=None)  # a restarted operator writes what it sees first
