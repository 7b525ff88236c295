"""`status.sizing`: the mode and why, the reserve rendered, and each rank's measurement beside
the memory others hold on its GPU (engine-measured only)."""

from __future__ import annotations

from rankguard_operator.core.budget.reserve import OutsideRank
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.sizing_mode import ENGINE_MEASURED, PINNED, SizingMode
from rankguard_operator.core.observe.outside_memory import Outside, kept
from rankguard_operator.core.status.sizing import sizing_status
from rankguard_operator.core.units import GiB

MEASURES = SizingMode(ENGINE_MEASURED, "EngineMeasures", "measured")
FOUND = Outside(
    ranks=(OutsideRank(1, "p", "GPU-1", 80 * GiB, 2 * GiB, 6 * GiB),),
    warmup=({"rank": 0, "blocks": 10}, {"rank": 1, "blocks": 9}),
)


def test_engine_measured_shows_the_reserve_and_every_rank() -> None:
    doc = sizing_status(MEASURES, FOUND, ServingFlags(engine_measured=True, gpu_memory_utilization=0.9))
    assert doc["mode"] == "engine-measured" and doc["reason"] == "EngineMeasures"
    assert doc["reserve"].startswith("gpu-memory-utilization 0.9, ")
    assert doc["ranks"] == [
        {"rank": 0, "blocks": 10},
        {
            "rank": 1,
            "blocks": 9,
            "uuid": "GPU-1",
            "pod": "p",
            "totalBytes": 80 * GiB,
            "othersBytes": 2 * GiB,
            "othersPeakBytes": 6 * GiB,
        },
    ]
    # what status keeps is read back for a pass without reports (a crashed engine's)
    assert kept(doc).ranks == FOUND.ranks


def test_the_pods_answers_are_kept_and_read_back() -> None:
    found = Outside(ranks=FOUND.ranks, vmm=False, imex_channel=True, engine_disabled="no VMM")
    doc = sizing_status(
        SizingMode(PINNED, "NoVirtualMemory", "m"), found, ServingFlags(kv_cache_memory_bytes=1)
    )
    assert (doc["vmm"], doc["imexChannel"], doc["engineDisabled"]) == (False, True, "no VMM")
    back = kept(doc)
    assert (back.vmm, back.imex_channel, back.engine_disabled, back.ranks) == (
        False,
        True,
        "no VMM",
        FOUND.ranks,
    )


def test_kept_rows_that_do_not_read_are_skipped() -> None:
    rows = [{"rank": 1}, "x", {"rank": 2, "totalBytes": -1, "othersBytes": 0, "othersPeakBytes": 0}, None]
    assert kept({"ranks": rows, "vmm": "no"}) == Outside()
    assert kept({"ranks": {"not": "a list"}}) == Outside()
    assert kept(["not a mapping"]) == Outside()


def test_without_a_reserve_or_outside_figures_only_the_mode() -> None:
    assert "reserve" not in sizing_status(MEASURES, FOUND, ServingFlags(engine_measured=True))
    pinned = sizing_status(
        SizingMode(PINNED, "BudgetPinned", "pinned"), Outside(), ServingFlags(kv_cache_memory_bytes=1)
    )
    assert pinned == {"mode": "pinned", "reason": "BudgetPinned", "message": "pinned"}
