"""What the agents say an engine that measures its own KV cache cannot see: the newest report of
each rank, outside memory at its peak, the warm-up figures, and the pod-level VMM and IMEX
answers (one pod without decides for the service)."""

from __future__ import annotations

from dataclasses import replace

from rankguard_agent.wire.report import RankSample, Report
from rankguard_agent.wire.report_memory import OtherProcess, WarmupMemory
from rankguard_operator.core.observe.outside_memory import outside
from rankguard_operator.core.units import GiB

TOTAL = 80 * GiB
WARM = WarmupMemory(
    free_bytes=30 * GiB,
    committed_bytes=2 * GiB,
    kept_bytes=3 * GiB,
    peak_bytes=3 * GiB,
    torch_growth_bytes=1 * GiB,
    blocks=9000,
    blocks_bytes=26 * GiB,
    requested_bytes=TOTAL,
    torch_cap_bytes=40 * GiB,
)


def sample(
    rank: int, *, others: int | None = None, peak: int | None = None, warm: WarmupMemory | None = None
) -> RankSample:
    procs = [] if not others else [OtherProcess(4242, "trainer", others)]
    return RankSample(
        rank, f"GPU-{rank}", TOTAL, 10 * GiB, 70 * GiB, 70 * GiB, 10.0,
        others_bytes=others, others_peak_bytes=peak, others=procs, warmup=warm,
    )  # fmt: skip


def report(
    *ranks: RankSample, vmm: bool | None = None, imex: bool | None = None, disabled: str | None = None
) -> Report:
    return Report(1, "t", 0.0, list(ranks), vmm=vmm, imex_channel=imex, extensible_disabled=disabled)


def test_nothing_reported_is_nothing_known() -> None:
    o = outside([("p", report(sample(0)), 1.0)])
    assert (o.ranks, o.warmup, o.vmm, o.imex_channel, o.engine_disabled) == ((), (), None, None, None)


def test_the_newest_report_of_a_rank_wins_and_the_peak_is_never_below_now() -> None:
    old = ("p0", report(sample(0, others=1 * GiB, peak=1 * GiB)), 1.0)
    new = ("p0", report(sample(0, others=6 * GiB, peak=2 * GiB)), 2.0)
    o = outside([new, old])
    [r] = o.ranks
    assert (r.others_bytes, r.others_peak_bytes, r.pod) == (6 * GiB, 6 * GiB, "p0")
    assert r.biggest is not None and "pid 4242 (trainer)" in r.biggest


def test_warm_up_rows_per_rank_in_rank_order() -> None:
    o = outside([("p1", report(sample(3, warm=WARM), sample(1, warm=WARM)), 1.0)])
    assert [w["rank"] for w in o.warmup] == [1, 3]
    assert o.warmup[0]["blocks"] == 9000 and o.warmup[0]["torchCapBytes"] == 40 * GiB


def test_one_pod_without_vmm_or_imex_decides_for_the_service() -> None:
    o = outside([("a", report(vmm=True, imex=True), 1.0), ("b", report(vmm=False, imex=None), 1.0)])
    assert (o.vmm, o.imex_channel) == (False, True)
    o = outside([("a", report(imex=True), 1.0), ("b", report(imex=False, disabled="no VMM"), 1.0)])
    assert (o.imex_channel, o.engine_disabled) == (False, "no VMM")


def test_what_status_kept_stands_in_for_pods_that_do_not_report() -> None:
    before = outside([("p0", report(sample(0, others=6 * GiB, peak=6 * GiB), vmm=False, imex=False), 1.0)])
    # the crashed engine's pod says nothing this pass: the kept figures and answers stand
    assert outside([], before) == replace(before, warmup=())
    # a new pod's agent starts its own peak: the kept peak stays; its own answers win
    later = outside([("p1", report(sample(0, others=1 * GiB, peak=1 * GiB), vmm=True), 2.0)], before)
    [r] = later.ranks
    assert (r.others_bytes, r.others_peak_bytes, r.pod) == (1 * GiB, 6 * GiB, "p1")
    assert (later.vmm, later.imex_channel) == (True, False)
