"""Aggregating agent reports: worst replica per rank, the bottleneck, staleness, probe figures."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from rankguard_agent.wire.report import KVLine, ProbeRank, ProbeResult, RankSample, Report
from rankguard_operator.core.budget.planner import RankMeasurement
from rankguard_operator.core.observe.headroom import aggregate, gpu_totals
from rankguard_operator.core.units import GiB, MiB

TOTAL = 80 * GiB
NOW = 10_000.0


def report(
    min_free: Sequence[int],
    *,
    free: Sequence[int] | None = None,
    probe: ProbeResult | None = None,
    kv: Sequence[KVLine] = (),
    sampler_ok: bool = True,
    errors: dict[int, str] | None = None,
) -> Report:
    free = free if free is not None else [m + 100 * MiB for m in min_free]
    errors = errors or {}
    return Report(
        version=1,
        agent_version="0.1.0",
        timestamp=NOW,
        ranks=[
            RankSample(
                rank=i,
                uuid=f"GPU-{i}",
                total_bytes=TOTAL,
                used_bytes=TOTAL - f,
                free_bytes=f,
                min_free_bytes=m,
                window_seconds=60.0,
                error=errors.get(i),
            )
            for i, (m, f) in enumerate(zip(min_free, free, strict=True))
        ],
        probe=probe,
        kv_lines=list(kv),
        sampler_ok=sampler_ok,
    )


def test_one_pod_bottleneck_is_the_rank_with_least_headroom_not_rank_0() -> None:
    obs = aggregate([("pod-a", report([3 * GiB, 2 * GiB, GiB, 2 * GiB]), NOW)], NOW, 30)
    assert [r.rank for r in obs.ranks] == [0, 1, 2, 3]
    assert obs.bottleneck_rank == 2 and obs.min_headroom_bytes == GiB
    b = obs.bottleneck
    assert b is not None and (b.uuid, b.pod, b.total_bytes, b.headroom_bytes) == (
        "GPU-2",
        "pod-a",
        TOTAL,
        GiB,
    )
    assert obs.has_fresh_data and obs.fresh_pods == ("pod-a",) and obs.stale_count == 0


def test_worst_replica_per_rank() -> None:
    obs = aggregate(
        [
            ("pod-b", report([GiB, 4 * GiB]), NOW),
            ("pod-a", report([2 * GiB, 3 * GiB]), NOW - 5),
        ],
        NOW,
        30,
    )
    r0, r1 = obs.ranks
    assert (r0.pod, r0.min_free_bytes) == ("pod-b", GiB)
    assert (r1.pod, r1.min_free_bytes) == ("pod-a", 3 * GiB)
    assert obs.bottleneck_rank == 0


def test_ties_go_to_the_lowest_rank_and_the_first_pod() -> None:
    obs = aggregate([("pod-b", report([GiB, GiB]), NOW), ("pod-a", report([GiB, GiB]), NOW)], NOW, 30)
    assert obs.bottleneck_rank == 0 and obs.ranks[0].pod == "pod-a"


def test_stale_reports_are_shown_but_never_used() -> None:
    obs = aggregate(
        [("old", report([100 * MiB, 100 * MiB]), NOW - 31), ("new", report([2 * GiB, 3 * GiB]), NOW - 30)],
        NOW,
        30,
    )
    assert obs.fresh_pods == ("new",) and obs.stale_pods == ("old",)
    assert obs.min_headroom_bytes == 2 * GiB  # the old pod's 100 MiB is not acted upon
    assert any("31s old" in n for n in obs.notes)

    only_stale = aggregate([("old", report([100 * MiB, GiB]), NOW - 120)], NOW, 30)
    assert not only_stale.has_fresh_data and only_stale.bottleneck is None
    assert [r.stale for r in only_stale.ranks] == [True, True]
    assert only_stale.min_headroom_bytes is None and only_stale.stale_count == 1


def test_unhealthy_sampler_and_lost_gpus_are_excluded() -> None:
    obs = aggregate([("a", report([GiB, 2 * GiB], sampler_ok=False), NOW)], NOW, 30)
    assert not obs.has_fresh_data and obs.stale_pods == ("a",)
    obs2 = aggregate([("a", report([GiB, 2 * GiB], errors={0: "GpuIsLost"}), NOW)], NOW, 30)
    assert obs2.bottleneck_rank == 1
    r0 = obs2.rank(0)
    assert r0 is not None and r0.stale and r0.error == "GpuIsLost"
    assert obs2.rank(7) is None


def test_probe_figures_worst_per_rank_from_ok_probes_only() -> None:
    def probe(free_after: Sequence[int], ok: bool = True) -> ProbeResult:
        return ProbeResult(
            ok=ok,
            backend="nccl",
            world_size=len(free_after),
            ranks=[ProbeRank(i, TOTAL - GiB, f, TOTAL - GiB - f) for i, f in enumerate(free_after)],
        )

    obs = aggregate(
        [
            ("a", report([GiB, GiB], probe=probe([75 * GiB, 74 * GiB])), NOW),
            ("b", report([GiB, GiB], probe=probe([74 * GiB, 76 * GiB])), NOW),
            ("c", report([GiB, GiB], probe=probe([1 * GiB, 1 * GiB], ok=False)), NOW),
        ],
        NOW,
        30,
    )
    assert obs.measurements == (
        RankMeasurement(0, total_bytes=TOTAL, free_after_init_bytes=74 * GiB),
        RankMeasurement(1, total_bytes=TOTAL, free_after_init_bytes=74 * GiB),
    )
    assert gpu_totals(obs) == obs.measurements
    no_probe = aggregate([("a", report([GiB]), NOW)], NOW, 30)
    assert gpu_totals(no_probe) == (RankMeasurement(0, total_bytes=TOTAL),)
    assert gpu_totals(None) == ()


def test_kv_cache_line_lowest_over_fresh_pods() -> None:
    line = KVLine(
        kind="available_kv_memory", text="Available KV cache memory: 30.00 GiB", value=30 * GiB, timestamp=NOW
    )
    smaller = KVLine(kind="available_kv_memory", text="...", value=29 * GiB, timestamp=NOW)
    tokens = KVLine(kind="kv_cache_tokens", text="GPU KV cache size: 1,000 tokens", value=1000, timestamp=NOW)
    obs = aggregate(
        [("a", report([GiB], kv=[line, tokens]), NOW), ("b", report([GiB], kv=[smaller]), NOW)], NOW, 30
    )
    assert obs.kv_cache_bytes == 29 * GiB
    assert aggregate([("a", report([GiB], kv=[tokens]), NOW)], NOW, 30).kv_cache_bytes is None


def test_empty() -> None:
    obs = aggregate([], NOW, 30)
    assert obs.ranks == () and not obs.has_fresh_data and obs.bottleneck_rank is None


mins = st.lists(st.integers(0, TOTAL), min_size=1, max_size=8)


@given(pods=st.lists(st.tuples(mins, st.floats(0, 100)), min_size=1, max_size=5), data=st.data())
def test_bottleneck_is_the_minimum_and_order_does_not_matter(
    pods: list[tuple[list[int], float]], data: st.DataObject
) -> None:
    inputs = [(f"pod-{i}", report(m, free=m), NOW - age) for i, (m, age) in enumerate(pods)]
    obs = aggregate(inputs, NOW, 30)
    fresh = [(m, age) for m, age in pods if NOW - (NOW - age) <= 30]
    if not fresh:
        assert obs.bottleneck is None
    else:
        assert obs.min_headroom_bytes == min(min(m) for m, _ in fresh)
        b = obs.bottleneck
        assert b is not None and not b.stale
    shuffled = data.draw(st.permutations(inputs))
    assert aggregate(shuffled, NOW, 30) == obs
