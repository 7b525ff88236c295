"""bench/strategies_late_sidecar.py: a late sidecar on rank 12 of a TP8×PP2 group (issue 50).

The first start dies allocating the KV cache on rank 12 (the sidecar came after vLLM's memory
snapshot); the first cut leaves room for what comes after the KV cache, so the next start of the
group serves: one roll where the cut of only the deficit and the margin took four (the next
start failed at CUDA-graph capture, the one after that on the pipeline's NCCL memory, then low
headroom). Fails on the code before issue 50 (3 crashes, 4 remediations)."""

from __future__ import annotations

import logging
import sys

from rankguard_sim.physics.scenario_data import GIB
from tests import REPO

sys.path.insert(0, str(REPO / "bench"))

import strategies_late_sidecar as ls


def test_one_roll_of_the_group_until_it_serves_where_there_were_four() -> None:
    logging.getLogger("rankguard_agent").setLevel(logging.ERROR)
    d = ls.drill(14 * GIB)
    r = d.result
    assert r.stable and r.crashes == 1 and d.rolls_to_serve == 1
    first = r.trace[1]
    assert "run 1 crashed: CUDAOutOfMemory on rank 12 in initialize-kv-cache" in first
    cut = r.trace[2]
    assert "shrink (CUDAOutOfMemory)" in cut and "allocating the KV cache" in cut
    # the only change after the OOM is reclaim taking back what the priors overstated, never
    # past the budget that failed; the capacity kept is what four rolls reached before
    assert d.triggers == ("CUDAOutOfMemory", "Reclaim")
    assert r.capacity is not None and r.capacity > 0.99


def test_the_sidecar_is_on_rank_12_only_and_after_the_snapshot() -> None:
    s = ls.late_sidecar_scenario(14 * GIB)
    [sidecar] = [c for c in s.components if c.name == "late_sidecar"]
    assert sidecar.phase == "late_other_process"
    assert [r for r in range(s.world_size) if sidecar.bytes_for(r)] == [ls.SIDECAR_RANK]
