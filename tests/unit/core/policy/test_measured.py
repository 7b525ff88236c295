"""The policy for an engine that measures its own KV cache (vLLM 0.34): never a byte budget; a
reserve for what the engine cannot see; the warm-up and serving levers; pinning the budget last;
one roll when the mode changes."""

from __future__ import annotations

import math
from dataclasses import replace

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.budget.reserve import OutsideRank
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.sizing_mode import ENGINE_MEASURED, PINNED, SizingMode
from rankguard_operator.core.observe.outside_memory import Outside
from rankguard_operator.core.observe.pods import Termination
from rankguard_operator.core.policy import Decision, PolicyInput, decide
from rankguard_operator.core.policy.history import Remediation, history_from_status
from rankguard_operator.core.units import GiB, MiB
from tests.unit.core.policy_world import CUR, DOC, KV, NOW, inp, spec_with, term

MEASURED_MODE = SizingMode(ENGINE_MEASURED, "EngineMeasures", "vLLM 0.34.0 sizes the KV cache")
PINNED_MODE = SizingMode(PINNED, "EngineEstimates", "vLLM 0.33.0 sizes from estimates")
MEASURED = ServingFlags(engine_measured=True)
TOTAL = 80 * GiB


def minp(**kw: object) -> PolicyInput:
    args: dict[str, object] = {"sizing": MEASURED_MODE, "current": MEASURED}
    args.update(kw)
    return inp(**args)


def oom(phase: str | None = tm.PHASE_SERVING, flags: ServingFlags = MEASURED, **kw: object) -> Termination:
    return replace(term(flags=flags, **kw), phase=phase)  # type: ignore[arg-type]


def neighbour(peak: int, rank: int = 0) -> Outside:
    return Outside(
        ranks=(OutsideRank(rank, "llama-0", f"GPU-{rank}", TOTAL, peak, peak, "pid 4242 (trainer) 6.0Gi"),)
    )


def test_the_first_flags_leave_the_sizing_to_the_engine() -> None:
    d = decide(minp(current=None))
    assert d.action == "initial"
    assert d.flags == ServingFlags(engine_measured=True)
    assert d.flags.kv_cache_memory_bytes is None and d.reason == "EngineMeasures"


def test_the_spec_s_utilisation_is_kept_as_the_reserve() -> None:
    s = spec_with(memory={**DOC["memory"], "gpuMemoryUtilization": 0.9})
    d = decide(minp(current=None, spec=s))
    assert d.flags == ServingFlags(engine_measured=True, gpu_memory_utilization=0.9)
    assert "reserve" in d.message


def test_a_mode_change_is_one_roll_each_way() -> None:
    to_measured = decide(minp(current=CUR))
    assert to_measured.action == "initial" and to_measured.changes_flags
    assert to_measured.flags.engine_measured and to_measured.trigger == "SizingModeChanged"
    assert to_measured.reason == "SizingModeChanged"
    assert to_measured.message.startswith(f"sizing mode now engine-measured ({MEASURED_MODE.message}); ")
    assert to_measured.message.count(MEASURED_MODE.message) == 1
    back = decide(minp(current=MEASURED, sizing=PINNED_MODE))
    assert back.action == "initial" and not back.flags.engine_measured
    assert back.flags.kv_cache_memory_bytes is not None
    assert back.reason == "SizingModeChanged" and back.message.startswith("sizing mode now pinned (")
    # settled: the same mode decides nothing
    assert decide(minp()).action == "none"
    assert decide(minp(sizing=PINNED_MODE, current=back.flags, budget_key=None)).action == "none"


def test_an_oom_with_a_neighbour_raises_the_reserve_over_its_peak() -> None:
    d = decide(minp(new_terminations=[oom(rank=0)], outside=neighbour(6 * GiB)))
    assert d.action == "raise-reserve" and d.reason == "RaiseReserve"
    u = d.flags.gpu_memory_utilization
    assert u is not None and TOTAL * (1 - u) >= 6 * GiB + 512 * MiB
    assert d.flags.engine_measured and d.flags.kv_cache_memory_bytes is None
    assert "pid 4242" in d.message and "GPU-0" in d.message
    # a reserve that already leaves the peak free: not the neighbour's doing, the levers answer
    again = decide(
        minp(current=d.flags, new_terminations=[oom(rank=0, flags=d.flags)], outside=neighbour(6 * GiB))
    )
    assert again.action == "lower-batched-tokens"


def test_a_serving_oom_without_outside_memory_moves_the_serving_levers() -> None:
    d = decide(minp(new_terminations=[oom()]))
    assert d.action == "lower-batched-tokens"
    assert d.flags.engine_measured and d.flags.kv_cache_memory_bytes is None


def test_a_capture_oom_moves_what_warm_up_holds() -> None:
    d = decide(minp(new_terminations=[oom(tm.PHASE_CUDA_GRAPHS)]))
    assert d.action == "lower-batched-tokens"


def _exhausted(flags: ServingFlags, phase: str) -> list[Remediation]:
    return [
        Remediation(
            NOW - 60, "CUDAOutOfMemory", "lower-num-seqs", 2, flags, flags, phase=phase, lever="max-num-seqs"
        )
    ]


def test_pinning_the_budget_is_the_last_lever() -> None:
    s = spec_with(remediation={"levers": {"minNumSeqs": 256, "minNumBatchedTokens": 8192}})
    d = decide(minp(spec=s, new_terminations=[oom()], history=_exhausted(MEASURED, tm.PHASE_SERVING)))
    assert d.action == "pin-budget" and d.reason == "PinBudget"
    assert d.flags.pinned_after_ooms and not d.flags.engine_measured
    assert d.flags.kv_cache_memory_bytes == KV


def test_kv_too_small_after_warm_up_moves_the_warm_up_levers() -> None:
    t = term("KVCacheTooSmall", flags=MEASURED)
    d: Decision = decide(minp(new_terminations=[t]))
    assert d.action == "lower-batched-tokens"
    assert d.flags.engine_measured


CONNECTOR = spec_with(
    engine={
        **DOC["engine"],
        "extraArgs": ['--kv-transfer-config={"kv_connector":"ExampleConnector","kv_role":"kv_both"}'],
    }
)


def started_at(free_at_load: int) -> Outside:
    return Outside(ranks=(OutsideRank(2, "llama-0", "GPU-2", TOTAL, 0, 0, None, free_at_load, 0),))


def test_a_connector_s_oom_reserves_its_buffers_from_the_engine_s_start() -> None:
    # the connector's buffers come when the cache is extended (0.34's extend_kv_cache): 1.5 GiB short
    t = oom(tm.PHASE_KV_ALLOCATION, requested=2 * GiB, free=512 * MiB)
    d = decide(minp(spec=CONNECTOR, new_terminations=[t], outside=started_at(74 * GiB)))
    assert d.action == "raise-reserve" and d.lever == "connector-reserve"
    u = d.flags.gpu_memory_utilization
    assert u is not None
    # once the request binds, vLLM leaves init_free − requested free: the deficit, vLLM's margin
    # (which its commit left before) and rankguard's own margin
    left = 74 * GiB - math.ceil(TOTAL * u)
    assert left >= 1536 * MiB + GiB + 512 * MiB
    assert "74Gi free when the engine started" in d.message
    # the lever survives the history's trip through status
    [back] = history_from_status([d.remediation(NOW).to_status()])
    assert back.lever == "connector-reserve"


def test_without_the_engine_s_start_each_connector_oom_lowers_it_again() -> None:
    t = oom(tm.PHASE_KV_ALLOCATION)
    first = decide(minp(spec=CONNECTOR, new_terminations=[t]))
    u1 = first.flags.gpu_memory_utilization
    assert first.lever == "connector-reserve" and u1 is not None and u1 < 1.0
    again = oom(tm.PHASE_KV_ALLOCATION, flags=first.flags)
    second = decide(minp(spec=CONNECTOR, current=first.flags, new_terminations=[again]))
    u2 = second.flags.gpu_memory_utilization
    assert second.lever == "connector-reserve" and u2 is not None and u2 < u1
    # a transient while serving is not the connector's: the serving levers
    serving = decide(minp(spec=CONNECTOR, new_terminations=[oom(tm.PHASE_SERVING)]))
    assert serving.action == "lower-batched-tokens"


def test_the_failed_run_s_own_figures_stand_in_for_its_reports() -> None:
    """A run that never turned ready was never scraped: the termination message of its OOM says
    where its engine started and what others grew to, and the reserve is computed from that."""
    t = replace(
        oom(rank=2), free_at_load_bytes=70 * GiB, others_at_load_bytes=2 * GiB, others_peak_bytes=8 * GiB
    )
    d = decide(minp(new_terminations=[t]))
    assert d.action == "raise-reserve" and d.lever == "reserve"
    u = d.flags.gpu_memory_utilization
    assert u is not None
    assert 70 * GiB - math.ceil(TOTAL * u) >= 6 * GiB + 512 * MiB  # the growth and the margin stay free
    # a neighbour that held the same all along is not the cause: the serving levers
    steady = replace(t, others_peak_bytes=2 * GiB)
    assert decide(minp(new_terminations=[steady])).action == "lower-batched-tokens"
