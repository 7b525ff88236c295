"""The policy for an engine that measures its own KV cache after warm-up (vLLM 0.34 and later).

Such an engine fills what it measures free on every rank, less a margin and what warm-up showed
it needs for transients, and caps torch's allocator there. rankguard never gives it a byte
budget (that would switch the measurement off); it steers with what the engine cannot see:

    the first flags      no --kv-cache-memory-bytes; --gpu-memory-utilization only as a reserve
                         (the spec's own, or none: vLLM's default 1.0 is best on a clean GPU)
    a CUDA OOM while     other processes on a rank's GPU hold more than the reserve leaves them:
    others hold memory   raise the reserve over their peak (the Event names the largest process
                         and the GPU), the tightest rank deciding for all
    a CUDA OOM after the a transient beyond torch's cap or a KV connector's buffers: the warm-up
    measurement          and serving levers (max-num-batched-tokens, then max-num-seqs; in
                         capture, the capture size and enforce-eager); a connector's first OOM
                         lowers the reserve by the deficit (its buffers come after the measure)
    KV too small after   the levers that shrink what warm-up holds
    warm-up
    nothing left         pin the budget in bytes (rankguard's own sizing), said as the last lever

The other rules (OOMKilled, failed rollouts, engine errors, crash loops) are the pinned mode's;
the headroom rules are not used: the engine sizes the cache from measured memory.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.budget.reserve import OutsideRank, lowered, reserve
from rankguard_operator.core.engine.rules import rules_for_image
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.sizing_mode import connector
from rankguard_operator.core.observe.pods import CUDA_OOM, KV_CACHE_TOO_SMALL, Termination
from rankguard_operator.core.policy.decision import Decision, PolicyInput, make_decision, rank_text
from rankguard_operator.core.policy.initial import initial_decision
from rankguard_operator.core.policy.oom_levers import next_lever
from rankguard_operator.core.policy.tunables import (
    LEVER_BATCHED,
    LEVER_CAPTURE,
    LEVER_CONNECTOR,
    LEVER_EAGER,
    LEVER_PIN,
    LEVER_RESERVE,
    LEVER_SEQS,
    T_CUDA_OOM,
    T_KV_TOO_SMALL,
)
from rankguard_operator.core.units import format_bytes

_WARMUP = (LEVER_BATCHED, LEVER_CAPTURE, LEVER_EAGER)
# phase -> the levers that shrink what it holds; a byte budget is never among them
LADDERS: dict[str, tuple[str, ...]] = {
    tm.PHASE_PROFILE: (LEVER_BATCHED, LEVER_SEQS),
    tm.PHASE_KV_ALLOCATION: _WARMUP,
    tm.PHASE_CUDA_GRAPHS: _WARMUP,
    tm.PHASE_SAMPLER_WARMUP: (LEVER_BATCHED, LEVER_SEQS),
    tm.PHASE_SERVING: (LEVER_BATCHED, LEVER_SEQS),
}
# the phase a KV-too-small refusal is answered in: what warm-up holds
_KV_TOO_SMALL_PHASE = tm.PHASE_CUDA_GRAPHS
# a connector's OOM without any GPU figure: its deficit as a share of a large GPU (conservative)
_ASSUMED_TOTAL = 80 << 30


def measured_initial(inp: PolicyInput, trigger: str) -> Decision:
    """The first flags of an engine-measured service: the engine's own sizing, with the spec's
    utilisation as the reserve when it gives one, and a raised memory limit kept."""
    sizing = inp.sizing
    assert sizing is not None
    util = inp.spec.memory.gpu_memory_utilization
    cur = inp.current
    limit = cur.memory_limit_bytes if cur is not None else None
    spec_limit = inp.spec.resources.memory_limit_bytes
    if limit is not None and spec_limit is not None and spec_limit >= limit:
        limit = None
    flags = ServingFlags(engine_measured=True, gpu_memory_utilization=util, memory_limit_bytes=limit)
    reserve_text = (
        f"; spec.memory.gpuMemoryUtilization {util:g} is kept as the reserve for memory the engine cannot see"
        if util is not None
        else "; no reserve: nothing else holds memory on its GPUs yet"
    )
    return make_decision(
        inp, "initial", flags, trigger=trigger, reason=sizing.reason, message=sizing.message + reserve_text
    )


def rule_cuda_oom_measured(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    ooms = [t for t in rel if t.kind == CUDA_OOM]
    if not ooms:
        return None
    worst = max(ooms, key=lambda t: -1 if t.deficit_bytes is None else t.deficit_bytes)
    keys = [t.key for t in ooms]
    what = f"{rank_text(worst.rank)} ran out of GPU memory in pod {worst.pod_name}"
    if worst.phase == tm.PHASE_WEIGHTS:
        return next_lever(inp, worst, what, keys, LADDERS)
    raised = _reserve_for_others(inp, worst, what, keys)
    if raised is not None:
        return raised
    if _connector_configured(inp) and worst.phase in (tm.PHASE_KV_ALLOCATION, None):
        # the connector's buffers come when the cache is extended, after vLLM measured
        raised = _reserve_for_connector(inp, worst, what, keys)
        if raised is not None:
            return raised
    phase = worst.phase if worst.phase in LADDERS else tm.PHASE_SERVING
    moved = next_lever(inp, _with_phase(worst, phase), what, keys, LADDERS)
    return moved if moved is not None else pin_budget(inp, worst, what, keys, T_CUDA_OOM)


def rule_kv_too_small_measured(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    ts = [t for t in rel if t.kind == KV_CACHE_TOO_SMALL]
    if not ts:
        return None
    t = ts[0]
    keys = [x.key for x in ts]
    what = f"vLLM measured too little memory after warm-up in pod {t.pod_name} for one request of maxModelLen"
    moved = next_lever(inp, _with_phase(t, _KV_TOO_SMALL_PHASE), what, keys, LADDERS)
    if moved is not None:
        return moved
    return pin_budget(inp, t, what, keys, T_KV_TOO_SMALL)


def _with_phase(t: Termination, phase: str) -> Termination:
    return t if t.phase == phase else replace(t, phase=phase)


def _outside_ranks(inp: PolicyInput, worst: Termination | None = None) -> tuple[OutsideRank, ...]:
    """What the agents said of each rank's GPU, with what the failed run's own agent wrote of the
    OOM's rank (its engine's start: the reports of a run that never became ready are not read)."""
    ranks = {r.rank: r for r in (inp.outside.ranks if inp.outside is not None else ())}
    if worst is None or worst.rank is None:
        return tuple(ranks.values())
    had = ranks.get(worst.rank)
    peak = worst.others_peak_bytes
    if had is None and peak is None:
        return tuple(ranks.values())
    if had is None:
        assert peak is not None
        had = OutsideRank(worst.rank, worst.pod_name, "", worst.total_bytes or 0, peak, peak)
    if peak is not None and peak > had.others_peak_bytes:
        had = replace(had, others_peak_bytes=peak)
    if worst.free_at_load_bytes is not None:
        had = replace(
            had, free_at_load_bytes=worst.free_at_load_bytes, others_at_load_bytes=worst.others_at_load_bytes
        )
    ranks[worst.rank] = had
    return tuple(ranks[k] for k in sorted(ranks))


def _reserve_for_others(
    inp: PolicyInput, worst: Termination, what: str, keys: Sequence[str]
) -> Decision | None:
    """Other processes grew on some rank's GPU since the engine measured, by more than the reserve
    in effect leaves them: a reserve over that growth (plus the margin), the tightest rank deciding."""
    cur = inp.current
    assert cur is not None
    margin = inp.spec.memory.safety_margin_bytes
    r = reserve(_outside_ranks(inp, worst), margin_bytes=margin)
    in_effect = cur.gpu_memory_utilization
    if r.utilization is None or (in_effect is not None and r.utilization >= in_effect):
        return None  # nothing grew, or the reserve already leaves it room: not theirs
    return _raise(
        inp,
        worst,
        keys,
        util=r.utilization,
        lever=LEVER_RESERVE,
        why=f"{what}: processes outside the engine took memory on its GPUs after vLLM measured it; "
        f"reserving {r.text}",
    )


def _raise(
    inp: PolicyInput, worst: Termination, keys: Sequence[str], *, util: float, lever: str, why: str
) -> Decision:
    cur = inp.current
    assert cur is not None
    was = "" if cur.gpu_memory_utilization is None else f" (was {cur.gpu_memory_utilization:g})"
    return make_decision(
        inp,
        "raise-reserve",
        replace(cur, gpu_memory_utilization=util),
        trigger=T_CUDA_OOM,
        reason="RaiseReserve",
        message=f"{why}, with gpu-memory-utilization {util:g}{was}",
        rank=worst.rank,
        handled=keys,
        phase=worst.phase,
        lever=lever,
    )


def _connector_configured(inp: PolicyInput) -> bool:
    return connector(inp.spec.engine.extra_args, rules_for_image(inp.spec.image).cli) is not None


def _vllm_margin(inp: PolicyInput) -> int:
    """vLLM's own margin floor on CUDA (the snapshot's): the commit leaves it free, then the
    connector's buffers come out of what is left."""
    ext = rules_for_image(inp.spec.image).snapshot.engine.get("extensible_kv_cache") or {}
    floor = ext.get("margin_floor_bytes", {}).get("cuda")
    return int(floor) if isinstance(floor, int) else 1 << 30


def _reserve_for_connector(
    inp: PolicyInput, worst: Termination, what: str, keys: Sequence[str]
) -> Decision | None:
    """A KV connector allocates its device buffers after vLLM measured: an OOM there says how much
    more to leave free (the deficit, beside vLLM's own margin, which the commit already left). With
    the engine's start seen (free at its init snapshot), one raise; without, each OOM lowers the
    utilisation by as much again until the request binds. None when it cannot go lower."""
    cur = inp.current
    assert cur is not None
    margin = inp.spec.memory.safety_margin_bytes
    deficit = worst.deficit_bytes or margin
    allowance = deficit + _vllm_margin(inp)
    r = reserve(_outside_ranks(inp, worst), allowance_bytes=allowance, margin_bytes=margin)
    if r.utilization is not None and r.rank is not None and r.rank.free_at_load_bytes is not None:
        util, text = r.utilization, r.text
    else:
        # the engine's start was not seen: lower from the utilisation in effect by the same amount
        total = worst.total_bytes or next((x.total_bytes for x in _outside_ranks(inp)), 0) or _ASSUMED_TOTAL
        util = lowered(cur.gpu_memory_utilization, allowance + margin, total)
        text = f"{format_bytes(allowance + margin)} below the utilisation in effect"
    if cur.gpu_memory_utilization is not None and util >= cur.gpu_memory_utilization:
        util = lowered(cur.gpu_memory_utilization, deficit + margin, worst.total_bytes or _ASSUMED_TOTAL)
        if util >= cur.gpu_memory_utilization:
            return None
    return _raise(
        inp,
        worst,
        keys,
        util=util,
        lever=LEVER_CONNECTOR,
        why=f"{what}: the KV connector allocates its device buffers after vLLM measured its memory "
        f"(deficit {format_bytes(deficit)}); reserving {text}",
    )


def pinned_start(inp: PolicyInput, trigger: str) -> Decision:
    """rankguard's own first flags, planned from priors as a fresh start would be: the probe's
    figures of an engine-measured run are not a pinned run's (no reclaim has tested them yet)."""
    return initial_decision(replace(inp, plan=inp.prior or inp.plan), trigger)


def pin_budget(
    inp: PolicyInput, worst: Termination, what: str, keys: Sequence[str], trigger: str
) -> Decision:
    """The engine-measured levers ran out: rankguard sizes the KV cache itself, as for vLLM 0.33,
    starting from its plan (the last lever of this mode, said as such)."""
    first = pinned_start(inp, trigger)
    flags = replace(first.flags, engine_measured=False, pinned_after_ooms=True)
    return make_decision(
        inp,
        "pin-budget",
        flags,
        trigger=trigger,
        reason="PinBudget",
        message=(
            f"{what}; no engine-measured lever is left, so rankguard pins the KV budget in bytes "
            f"({flags.describe()}): {first.message}"
        ),
        rank=worst.rank,
        handled=keys,
        phase=worst.phase,
        lever=LEVER_PIN,
    )
