"""The reserve an engine-measured service renders: what other processes grew by since the engine's
init snapshot, an allowance and the margin, left free after vLLM's commit on the tightest rank, as
one utilisation; nothing when nothing needs room."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_operator.core.budget.reserve import (
    MIN_UTILIZATION,
    OutsideRank,
    floor_utilization,
    lowered,
    reserve,
)
from rankguard_operator.core.units import GiB, MiB

TOTAL = 80 * GiB


def rank(
    r: int, peak: int, *, total: int = TOTAL, free_at_load: int | None = None, at_load: int | None = None
) -> OutsideRank:
    return OutsideRank(
        r, "llama-0", f"GPU-{r}", total, peak, peak, f"pid {100 + r} (x) 1Gi",
        free_at_load_bytes=free_at_load, others_at_load_bytes=at_load,
    )  # fmt: skip


def committed_free(init_free: int, util: float, transient: int = 0) -> int:
    """What vLLM 0.34 leaves free after its commit once the request binds
    (measure_kv_cache_bytes: requested − used since the snapshot − transients)."""
    return init_free - math.ceil(TOTAL * util) + transient


def test_nothing_grew_renders_no_utilisation() -> None:
    assert reserve([rank(0, 0), rank(1, 0)], margin_bytes=512 * MiB).utilization is None
    assert reserve([], margin_bytes=512 * MiB).utilization is None
    # a neighbour that held the same since the engine's snapshot: vLLM already measured it
    same = rank(0, 4 * GiB, free_at_load=70 * GiB, at_load=4 * GiB)
    assert reserve([same], margin_bytes=512 * MiB).utilization is None


def test_the_growth_since_the_snapshot_is_left_free_after_the_commit() -> None:
    # 2 GiB held when the engine started, 8 GiB at its peak: 6 GiB more must fit beside the cache
    r = reserve([rank(0, 8 * GiB, free_at_load=74 * GiB, at_load=2 * GiB)], margin_bytes=512 * MiB)
    assert r.utilization is not None
    assert committed_free(74 * GiB, r.utilization) >= 6 * GiB + 512 * MiB
    assert committed_free(74 * GiB, r.utilization) < 6 * GiB + 512 * MiB + 16 * MiB  # no more than the step
    assert "6Gi other processes grew" in r.text and "74Gi free when the engine started" in r.text


def test_the_tightest_rank_sets_one_utilisation_for_all() -> None:
    ranks = [
        rank(0, 3 * GiB, free_at_load=70 * GiB, at_load=1 * GiB),
        rank(1, 6 * GiB, free_at_load=60 * GiB, at_load=2 * GiB),  # less free at its start
        rank(2, 0, free_at_load=75 * GiB, at_load=0),
    ]
    r = reserve(ranks, margin_bytes=512 * MiB)
    assert r.rank is not None and r.rank.rank == 1
    assert r.utilization is not None
    assert committed_free(60 * GiB, r.utilization) >= 4 * GiB + 512 * MiB
    assert committed_free(70 * GiB, r.utilization) >= 2 * GiB + 512 * MiB


def test_without_the_snapshot_the_total_is_the_base() -> None:
    r = reserve([rank(0, 6 * GiB)], margin_bytes=512 * MiB)
    assert r.utilization == floor_utilization((TOTAL - 6 * GiB - 512 * MiB) / TOTAL)
    assert "counted from the GPU's total" in r.text


def test_the_allowance_counts_on_every_rank_even_without_growth() -> None:
    quiet = rank(0, 0, free_at_load=70 * GiB, at_load=0)
    r = reserve([quiet], allowance_bytes=3 * GiB, margin_bytes=0)
    assert r.utilization is not None and committed_free(70 * GiB, r.utilization) >= 3 * GiB
    assert "3Gi learned after an OOM" in r.text
    assert (
        reserve([quiet], allowance_bytes=3 * GiB, margin_bytes=0, growth=False).utilization == r.utilization
    )


def test_an_absurd_reserve_is_bounded() -> None:
    assert reserve([rank(0, TOTAL)], margin_bytes=GiB).utilization == MIN_UTILIZATION


def test_lowered_counts_from_the_default_when_unset() -> None:
    assert lowered(None, 8 * GiB, TOTAL) == 0.9
    assert lowered(0.9, 8 * GiB, TOTAL) == 0.8
    assert lowered(0.1, TOTAL, TOTAL) == MIN_UTILIZATION


@given(
    st.integers(40 * GiB, 78 * GiB), st.integers(0, 8 * GiB), st.integers(0, 8 * GiB), st.integers(0, 2 * GiB)
)
def test_the_reserve_is_always_left_free(init_free: int, held: int, grew: int, margin: int) -> None:
    r = reserve([rank(0, held + grew, free_at_load=init_free, at_load=held)], margin_bytes=margin)
    if grew == 0:
        assert r.utilization is None
        return
    assert r.utilization is not None
    if r.utilization > MIN_UTILIZATION:
        assert committed_free(init_free, r.utilization) >= grew + margin


@pytest.mark.parametrize(("value", "expected"), [(1.5, 1.0), (0.99999, 0.9999), (0.0, MIN_UTILIZATION)])
def test_floor_utilization(value: float, expected: float) -> None:
    assert floor_utilization(value) == expected
