"""Rule 1 by phase: a CUDA OOM answered by the lever that addresses the engine phase it came from.

vLLM 0.33's engine core starts in a known order (load the weights, profile run, KV allocation,
CUDA-graph capture, sampler warm-up) and then serves; the agent says which phase a rank was in
when it ran out (the termination message's `phase`). A smaller KV budget fixes only what comes
after the KV cache is allocated; each phase has its own levers, cheapest in served tokens first:

    weights             none: Degraded WeightsDoNotFit, naming the TP (or GPU size) that fits
    profile             max-num-batched-tokens, then max-num-seqs
    kv-allocation       the KV budget (rule 1 as before: crash_rules.rule_cuda_oom)
    cuda-graph-capture  the KV budget (only while it stays >= its floor), then
                        max-cudagraph-capture-size, then enforce-eager
    sampler-warmup      the KV budget (only while it stays >= its floor), then max-num-seqs
    serving             the KV budget (only while it stays >= its floor), then max-num-seqs

An unknown phase (None) keeps rule 1 as it was. Every lever but enforce-eager is halved, never
below its floor (spec.remediation.levers; max-num-batched-tokens also never below max-num-seqs,
which vLLM requires). Escalation: the trailing CUDA-OOM remediations of the same phase in the
history, each within ESCALATION_WINDOW_SECONDS of the next (the newest of now), say which lever
moved last; a new OOM of that phase moves the next lever, and the ladder's last lever keeps
moving until its floor. A lever that cannot move (at its floor, a pinned budget, the user's own
capture sizes, enforce-eager not allowed) is passed over; with none left the service is
Degraded (OOMLeversExhausted) and nothing rolls. The guard rails and rollbacks treat every lever
like the budget: they are ServingFlags.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.budget.bounds import kv_floor
from rankguard_operator.core.budget.fits import weights_fit
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.pods import Termination
from rankguard_operator.core.policy.budget_change import (
    budget_change,
    clamped_target,
    effective_budget,
    oom_deficit,
)
from rankguard_operator.core.policy.decision import Action, Decision, PolicyInput, make_decision
from rankguard_operator.core.policy.history import STATUS_ACTIONS, Remediation
from rankguard_operator.core.policy.tunables import (
    ESCALATION_WINDOW_SECONDS,
    KNOBS,
    LEVER_BATCHED,
    LEVER_CAPTURE,
    LEVER_EAGER,
    LEVER_FIELDS,
    LEVER_KV,
    LEVER_SEQS,
    T_CUDA_OOM,
)
from rankguard_operator.core.units import format_bytes

# phase -> its levers, cheapest in served tokens first (the weights phase has none)
LADDERS: dict[str, tuple[str, ...]] = {
    tm.PHASE_PROFILE: (LEVER_BATCHED, LEVER_SEQS),
    tm.PHASE_KV_ALLOCATION: (LEVER_KV,),
    tm.PHASE_CUDA_GRAPHS: (LEVER_KV, LEVER_CAPTURE, LEVER_EAGER),
    tm.PHASE_SAMPLER_WARMUP: (LEVER_KV, LEVER_SEQS),
    tm.PHASE_SERVING: (LEVER_KV, LEVER_SEQS),
}
PHASE_TEXT: dict[str, str] = {
    tm.PHASE_WEIGHTS: "while loading the weights",
    tm.PHASE_PROFILE: "in the profile run",
    tm.PHASE_KV_ALLOCATION: "while allocating the KV cache",
    tm.PHASE_CUDA_GRAPHS: "during CUDA-graph capture",
    tm.PHASE_SAMPLER_WARMUP: "in the sampler warm-up",
    tm.PHASE_SERVING: "while serving",
}
ACTIONS: dict[str, Action] = {
    LEVER_KV: "shrink",
    LEVER_BATCHED: "lower-batched-tokens",
    LEVER_SEQS: "lower-num-seqs",
    LEVER_CAPTURE: "lower-capture-size",
    LEVER_EAGER: "enforce-eager",
}
# vLLM 0.33's largest default CUDA-graph capture size when --max-cudagraph-capture-size is unset:
# config/vllm.py VllmConfig._set_cudagraph_sizes takes min(max_num_seqs * decode_query_len * 2,
# 512), 1024 on data-centre Blackwell (device capability family 100), then min(that,
# max_num_batched_tokens); decode_query_len is 1 without speculative decoding. The GPU's family
# is not known here: 512 is assumed, so half of it is a real cut on either platform.
VLLM_DEFAULT_CAPTURE_CEILING = 512


@dataclass(frozen=True)
class Move:
    """One lever moved: the flags after, its value before and after, and where the old value came from."""

    flags: ServingFlags
    old: int | bool
    new: int | bool
    source: str


def escalation_run(history: Sequence[Remediation], phase: str, now: float) -> list[Remediation]:
    """The trailing CUDA-OOM remediations of `phase`, newest first: each within the escalation
    window of the next (the newest within it of `now`); any other change ends the run."""
    run: list[Remediation] = []
    later = now
    for h in sorted(history, key=lambda h: h.time, reverse=True):
        if h.trigger != T_CUDA_OOM or h.phase != phase or later - h.time > ESCALATION_WINDOW_SECONDS:
            break
        run.append(h)
        later = h.time
    return run


def next_levers(ladder: tuple[str, ...], run: Sequence[Remediation]) -> tuple[str, ...]:
    """The levers to try, in order: those after the one that moved last (the ladder's last keeps
    moving until its floor); the whole ladder when nothing of this phase moved lately."""
    if not run or run[0].lever not in ladder:
        return ladder
    i = ladder.index(str(run[0].lever))
    return ladder[i + 1 :] if i + 1 < len(ladder) else ladder[i:]


# --------------------------------------------------------------------------------------------
# The levers' values in effect, and one move of each


def _in_effect(inp: PolicyInput, field: str, spec_value: int, spec_name: str) -> tuple[int, str]:
    """A batch limit in effect and where it comes from: rankguard's flag, else the spec's."""
    assert inp.current is not None
    value = getattr(inp.current, field)
    return (value, "set by rankguard") if value is not None else (spec_value, spec_name)


def seqs_in_effect(inp: PolicyInput) -> tuple[int, str]:
    return _in_effect(inp, "max_num_seqs", inp.spec.engine.max_num_seqs, "spec.engine.maxNumSeqs")


def batched_in_effect(inp: PolicyInput) -> tuple[int, str]:
    engine = inp.spec.engine
    return _in_effect(
        inp, "max_num_batched_tokens", engine.max_num_batched_tokens, "spec.engine.maxNumBatchedTokens"
    )


def capture_in_effect(inp: PolicyInput) -> tuple[int, str]:
    """The largest CUDA-graph capture size vLLM 0.33 uses under the current flags."""
    cur = inp.current
    assert cur is not None
    if cur.max_cudagraph_capture_size is not None:
        return cur.max_cudagraph_capture_size, "set by rankguard"
    seqs, _ = seqs_in_effect(inp)
    batched, _ = batched_in_effect(inp)
    size = min(seqs * 2, VLLM_DEFAULT_CAPTURE_CEILING, batched)
    return size, f"vLLM's default: min(2 × max-num-seqs {seqs}, {VLLM_DEFAULT_CAPTURE_CEILING}, {batched})"


def eager_in_effect(inp: PolicyInput) -> bool:
    assert inp.current is not None
    return inp.current.or_spec("enforce_eager", inp.spec.engine.enforce_eager)


def _halve(inp: PolicyInput, lever: str, in_effect: tuple[int, str], floor: int, why: str) -> Move | str:
    """`lever` halved from the value in effect, never below `floor` (`why` names it); else why not."""
    assert inp.current is not None
    old, source = in_effect
    new = max(old // 2, floor)
    if new >= old:
        return f"{lever} {old} is at its floor {floor} ({why})"
    moved: dict[str, Any] = {LEVER_FIELDS[lever]: new}
    return Move(replace(inp.current, **moved), old, new, source)


def move_seqs(inp: PolicyInput) -> Move | str:
    floor = inp.spec.remediation.levers.min_num_seqs
    return _halve(inp, LEVER_SEQS, seqs_in_effect(inp), floor, "spec.remediation.levers.minNumSeqs")


def move_batched(inp: PolicyInput) -> Move | str:
    seqs, _ = seqs_in_effect(inp)
    floor, why = (
        inp.spec.remediation.levers.min_num_batched_tokens,
        "spec.remediation.levers.minNumBatchedTokens",
    )
    if seqs > floor:
        floor, why = seqs, "max-num-seqs: vLLM refuses fewer batched tokens than sequences"
    if inp.spec.engine.chunked_prefill_off:
        mml = inp.spec.engine.max_model_len or (inp.plan.max_model_len if inp.plan is not None else None)
        if mml is None:
            return "max-num-batched-tokens stays: chunked prefill is off and the max model length is unknown"
        if mml > floor:
            floor, why = mml, "max-model-len: chunked prefill is off (spec.engine.extraArgs)"
    return _halve(inp, LEVER_BATCHED, batched_in_effect(inp), floor, why)


def move_capture(inp: PolicyInput) -> Move | str:
    if eager_in_effect(inp):
        return "max-cudagraph-capture-size stays: the engine runs eager and captures no CUDA graphs"
    user = inp.spec.engine.capture_sizes_flag
    if user is not None:
        return f"max-cudagraph-capture-size stays: spec.engine.extraArgs set the capture sizes ({user})"
    floor = inp.spec.remediation.levers.min_cudagraph_capture_size
    return _halve(
        inp, LEVER_CAPTURE, capture_in_effect(inp), floor, "spec.remediation.levers.minCudaGraphCaptureSize"
    )


def move_eager(inp: PolicyInput) -> Move | str:
    cur = inp.current
    assert cur is not None
    if eager_in_effect(inp):
        return "enforce-eager is already on"
    if not inp.spec.remediation.levers.allow_enforce_eager:
        return "enforce-eager is not allowed (spec.remediation.levers.allowEnforceEager: false)"
    return Move(replace(cur, enforce_eager=True), False, True, "spec.engine.enforceEager")


MOVES = {
    LEVER_BATCHED: move_batched,
    LEVER_SEQS: move_seqs,
    LEVER_CAPTURE: move_capture,
    LEVER_EAGER: move_eager,
}


def kv_move(
    inp: PolicyInput, worst: Termination, why: str, handled: Sequence[str], step: str
) -> Decision | str:
    """The KV budget by the OOM's deficit plus the safety margin (rule 1's arithmetic), when
    that keeps it at or above its floor; else why not. Below the floor the next lever moves."""
    cur = inp.current
    assert cur is not None
    if inp.spec.memory.pinned:
        return "the KV budget is pinned (spec.memory.kvCacheMemoryBytes)"
    eff = effective_budget(inp, worst, worst.rank)
    if eff is None:
        return "rankguard cannot tell the KV budget in effect"
    base, base_text = eff
    margin = inp.spec.memory.safety_margin_bytes
    deficit, _ = oom_deficit(worst, base)
    # budget_change's own clamp, to know before asking it whether the floor holds
    floor = kv_floor(inp.spec, inp.plan)
    target = clamped_target(inp, "shrink", base - deficit - margin)
    if target < floor:
        drop = format_bytes(max(target, 0))
        return f"the KV budget would drop to {drop}, below its floor {format_bytes(floor)}"
    how = (
        f" (deficit {format_bytes(deficit)} plus the {format_bytes(margin)} safety margin; "
        f"lever {LEVER_KV}{step})"
    )
    if cur.kv_cache_memory_bytes is None:
        how += f"; switching from gpu-memory-utilization to bytes, starting from {base_text}"
    d = budget_change(
        inp, "shrink", base - deficit - margin, base, trigger=T_CUDA_OOM, why=why, rank=worst.rank,
        handled=handled, how=how,
    )  # fmt: skip
    return replace(d, phase=worst.phase, lever=LEVER_KV)


# --------------------------------------------------------------------------------------------
# The rule


def _value(v: int | bool) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def _moved(h: Remediation) -> str:
    """`max-num-seqs 256 -> 128`, `kv-budget 38Gi -> 36Gi`: one past move, as history keeps it."""
    lever = h.lever or LEVER_KV
    field = LEVER_FIELDS.get(lever, "kv_cache_memory_bytes")
    new = getattr(h.to_flags, field)
    old = h.lever_from
    if old is None and h.from_flags is not None:
        old = getattr(h.from_flags, field)
    show = format_bytes if lever == LEVER_KV else _value
    return f"{lever} {'?' if old is None else show(old)} -> {'?' if new is None else show(new)}"


def _ordinal(i: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(i, f"{i}th")


def lever_decision(inp: PolicyInput, worst: Termination, what: str, handled: Sequence[str]) -> Decision:
    """Rule 1 for a CUDA OOM whose phase is known and is not the KV allocation's: the phase's next
    lever, or Degraded with nothing rolled when none is left."""
    moved = _next_lever(inp, worst, what, handled, LADDERS)
    if isinstance(moved, Decision):
        return moved
    why, skipped = moved
    run = escalation_run(inp.history, worst.phase or "", inp.now)
    tried = ", ".join(_moved(h) for h in reversed(run))
    after = f", again after rankguard moved {tried}" if tried else ""
    assert inp.current is not None
    return make_decision(
        inp,
        "degrade",
        inp.current,
        trigger=T_CUDA_OOM,
        reason="OOMLeversExhausted",
        message=(
            f"{why}{after}; no lever is left for this phase ({'; '.join(skipped)}), so rankguard rolls "
            f"nothing more. To fix: lower the floors in spec.remediation.levers, {KNOBS}"
        ),
        rank=worst.rank,
        handled=handled,
        phase=worst.phase,
    )


def next_lever(
    inp: PolicyInput,
    worst: Termination,
    what: str,
    handled: Sequence[str],
    ladders: Mapping[str, tuple[str, ...]],
) -> Decision | None:
    """The next lever of `ladders` for the OOM's phase (an engine that measures its own KV cache
    has its own: core/policy/measured.py); None when none is left, where the caller takes its
    own last lever."""
    moved = _next_lever(inp, worst, what, handled, ladders)
    return moved if isinstance(moved, Decision) else None


def _next_lever(
    inp: PolicyInput,
    worst: Termination,
    what: str,
    handled: Sequence[str],
    ladders: Mapping[str, tuple[str, ...]],
) -> Decision | tuple[str, list[str]]:
    """The move, or (why, what each lever's refusal said) when no lever is left."""
    cur = inp.current
    assert cur is not None and worst.phase is not None
    phase = worst.phase
    why = f"{what} {PHASE_TEXT.get(phase, f'in phase {phase}')}"
    if phase == tm.PHASE_WEIGHTS:
        return weights_decision(inp, worst, why, handled)
    ladder = ladders[phase]
    run = escalation_run(inp.history, phase, inp.now)
    skipped: list[str] = []
    for lever in next_levers(ladder, run):
        step = f", the {_ordinal(ladder.index(lever) + 1)} of {len(ladder)} for this phase"
        if lever == LEVER_KV:
            kv = kv_move(inp, worst, why, handled, step)
            if isinstance(kv, Decision):
                return kv
            skipped.append(kv)
            continue
        m = MOVES[lever](inp)
        if isinstance(m, str):
            skipped.append(m)
            continue
        action = ACTIONS[lever]
        flag = "--" + LEVER_FIELDS[lever].replace("_", "-")
        change = (
            f"turning on {flag}"
            if lever == LEVER_EAGER
            else f"lowering {flag} from {_value(m.old)} ({m.source}) to {_value(m.new)}"
        )
        moved = f"; {skipped[-1]}" if skipped else ""
        return make_decision(
            inp,
            action,
            m.flags,
            trigger=T_CUDA_OOM,
            reason=STATUS_ACTIONS[action],
            message=f"{why}{moved}; {change} (lever {lever}{step})",
            rank=worst.rank,
            handled=handled,
            phase=phase,
            lever=lever,
            lever_from=m.old,
        )
    return why, skipped


def weights_decision(inp: PolicyInput, worst: Termination, why: str, handled: Sequence[str]) -> Decision:
    """The weights did not load: no flag rankguard manages frees memory before the KV cache
    exists, so nothing rolls; Degraded with the split or GPU size the planner says would fit."""
    cur = inp.current
    assert cur is not None
    spec = inp.spec
    split = f"tensorParallelSize {spec.tp}" + (f" × pipelineParallelSize {spec.pp}" if spec.pp > 1 else "")
    if inp.plan is None:
        fits = (
            "rankguard has no plan to say what would fit (one GPU's size is not known yet, or nothing "
            "describes the model): raise spec.tensorParallelSize or use GPUs with more memory"
        )
    else:
        fit = weights_fit(inp.plan, worst.deficit_bytes)
        if fit is None:
            fits = (
                "the model is measured, not planned, so the planner cannot say what would fit: raise "
                "spec.tensorParallelSize or use GPUs with more memory"
            )
        else:
            more_tp = (
                f"the planner says spec.tensorParallelSize {fit.tp} would fit on these GPUs"
                if fit.tp is not None
                else "the planner finds no larger spec.tensorParallelSize that fits on these GPUs"
            )
            gpu = (
                f"GPUs with at least {format_bytes(fit.gpu_bytes)} each would hold the current split"
                if fit.gpu_bytes is not None
                else "GPUs with more memory than these would be needed at the current split"
            )
            fits = f"{more_tp}, or {gpu}"
    return make_decision(
        inp,
        "degrade",
        cur,
        trigger=T_CUDA_OOM,
        reason="WeightsDoNotFit",
        message=(
            f"{why}: no flag rankguard manages makes the weights fit at {split}, so it rolls nothing; {fits}"
        ),
        rank=worst.rank,
        handled=handled,
        phase=tm.PHASE_WEIGHTS,
    )
