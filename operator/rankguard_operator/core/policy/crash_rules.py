"""Rule 0b: the image's vLLM refused the arguments. Rules 1-5b: a run ended badly (CUDA OOM, KV
cache too small, OOMKilled, a failed rollout, an engine error after a change, an engine error no
rollback can fix). A CUDA OOM of a known phase other than the KV allocation's is answered by
that phase's lever (oom_levers.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import replace

from rankguard_agent.wire.termination import PHASE_KV_ALLOCATION
from rankguard_operator.core.budget.bounds import kv_floor
from rankguard_operator.core.observe.pod_blockers import refusal
from rankguard_operator.core.observe.pods import (
    CUDA_OOM,
    ENGINE_ERROR,
    ENGINE_REFUSED,
    KV_CACHE_TOO_SMALL,
    OOM_KILLED,
    SIGKILLED,
    Termination,
)
from rankguard_operator.core.policy.budget_change import (
    after_kv_room,
    budget_change,
    effective_budget,
    oom_deficit,
    utilization_base,
)
from rankguard_operator.core.policy.decision import (
    Decision,
    PolicyInput,
    last_change,
    make_decision,
    rank_text,
)
from rankguard_operator.core.policy.history import STATUS_ACTIONS
from rankguard_operator.core.policy.oom_levers import PHASE_TEXT, lever_decision
from rankguard_operator.core.policy.startup_refusals import startup_refusal
from rankguard_operator.core.policy.tunables import (
    KNOBS,
    LEVER_KV,
    T_CUDA_OOM,
    T_ENGINE_ERROR,
    T_ENGINE_REFUSED,
    T_KV_TOO_SMALL,
    T_OOM_KILLED,
    T_ROLLOUT_FAILED,
    VPA_MIN_BUMP_BYTES,
)
from rankguard_operator.core.units import MiB, format_bytes


def rule_engine_refused(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    """Rule 0b: the image's own vLLM refused the arguments before the engine started (the
    agent's engine judge). Nothing ran, so nothing about memory is known; the same arguments
    are refused on every start, so neither a lever nor a rollback can help (a rollback keeps the
    spec's arguments) and a crash loop it is not: Degraded, quoting vLLM, until a person changes
    the spec. With a Deployment the rollout says it on every pass for as long as a pod of the
    template in effect refuses (a pod of an older template, or one that runs again, does not);
    a multi-node service, which has no rollout, says it when a refusal ends a run; so does a pod
    of the template in effect whose refused run ended but which already runs again."""
    ended = [t for t in rel if t.kind == ENGINE_REFUSED]
    r = inp.rollout
    ours = [t for t in ended if r is None or t.template_hash == r.template_hash]
    refused = (r.refused if r is not None else None) or next(iter(ours), None)
    if refused is None:
        return None
    cur = inp.current
    assert cur is not None
    return make_decision(
        inp,
        "degrade",
        cur,
        trigger=T_ENGINE_REFUSED,
        reason=T_ENGINE_REFUSED,
        message=refusal(refused).message(0),
        rank=refused.rank,
        handled=[t.key for t in ended],
    )


def rule_cuda_oom(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    ooms = [t for t in rel if t.kind == CUDA_OOM]
    if not ooms:
        return None
    cur = inp.current
    assert cur is not None
    keys = [t.key for t in ooms]
    # the worst failure decides: the largest stated deficit, else the first
    worst = max(ooms, key=lambda t: -1 if t.deficit_bytes is None else t.deficit_bytes)
    what = f"{rank_text(worst.rank)} ran out of GPU memory in pod {worst.pod_name}"
    if worst.requested_bytes is not None and worst.free_bytes is not None:
        what += (
            f" (tried to allocate {format_bytes(worst.requested_bytes)} with "
            f"{format_bytes(worst.free_bytes)} free)"
        )
    margin = inp.spec.memory.safety_margin_bytes
    refused = startup_refusal(inp, ooms, worst)
    if refused is not None:
        return refused
    if worst.phase is not None and worst.phase != PHASE_KV_ALLOCATION:
        # a phase before the KV cache exists, or after it: its own lever (oom_levers.py)
        return lever_decision(inp, worst, what, keys)
    if inp.spec.memory.pinned:
        need = (worst.deficit_bytes or 0) + margin
        return make_decision(
            inp,
            "degrade",
            cur,
            trigger=T_CUDA_OOM,
            reason="PinnedBudgetOOM",
            message=f"{what} under the pinned KV budget {cur.budget_text()}; rankguard never changes "
            f"spec.memory.kvCacheMemoryBytes: lower it by at least {format_bytes(need)}, or remove "
            f"it to let rankguard "
            "manage the budget",
            rank=worst.rank,
            handled=keys,
        )
    eff = effective_budget(inp, worst, worst.rank)
    if eff is None:
        return make_decision(
            inp,
            "degrade",
            cur,
            trigger=T_CUDA_OOM,
            reason="NoBudgetToConvert",
            message=(
                f"{what} under {cur.describe()}, and rankguard cannot tell the KV budget that was in effect; "
                "set spec.memory.gpuMemoryBytes (so rankguard can plan) or spec.memory.kvCacheMemoryBytes"
            ),
            rank=worst.rank,
            handled=keys,
        )
    base, base_text = eff
    deficit, assumed = oom_deficit(worst, base)
    after, after_text = 0, ""
    room = after_kv_room(inp, worst.rank) if worst.phase == PHASE_KV_ALLOCATION else None
    if room is not None:
        # The KV cache is allocated before the graphs are captured, the sampler warms up and the
        # first steps run, so under a byte budget they get what the cache left: a cut of only the
        # deficit and the margin fails again at capture (issue 50). The cut leaves them room.
        after = room[0]
        after_text = f", plus {format_bytes(after)} for {room[1]}, which come after the KV cache"
    if assumed:
        how = (
            f" (the message gave no figures: {format_bytes(deficit)} assumed, plus the "
            f"{format_bytes(margin)} safety margin{after_text})"
        )
    else:
        how = f" (deficit {format_bytes(deficit)} plus the {format_bytes(margin)} safety margin{after_text})"
    if cur.kv_cache_memory_bytes is None:
        how += f"; switching from gpu-memory-utilization to bytes, starting from {base_text}"
    if worst.phase is not None:
        how += f" (lever {LEVER_KV}, the only one for this phase)"
    d = budget_change(
        inp,
        "shrink",
        base - deficit - margin - after,
        base,
        trigger=T_CUDA_OOM,
        why=what if worst.phase is None else f"{what} while allocating the KV cache",
        rank=worst.rank,
        handled=keys,
        how=how,
    )
    # the KV allocation's OOM is rule 1 as it was; its history item says the phase and lever
    return d if worst.phase is None else replace(d, phase=worst.phase, lever=LEVER_KV)


def rule_kv_too_small(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    ts = [t for t in rel if t.kind == KV_CACHE_TOO_SMALL]
    if not ts:
        return None
    cur, spec, plan = inp.current, inp.spec, inp.plan
    assert cur is not None
    t = ts[0]
    keys = [x.key for x in ts]
    floor = kv_floor(spec, plan)
    what = (
        f"vLLM refused to start in pod {t.pod_name}: the KV budget ({cur.describe()}) cannot hold one "
        "request of maxModelLen"
    )
    if (
        cur.kv_cache_memory_bytes is None
        and not spec.memory.pinned
        and plan is not None
        and plan.kv_cache_memory_bytes >= floor
    ):
        return budget_change(
            inp,
            "replan",
            plan.kv_cache_memory_bytes,
            utilization_base(plan, cur),
            trigger=T_KV_TOO_SMALL,
            why=what,
            rank=plan.bottleneck_rank,
            handled=keys,
            how=" (the planned explicit budget, which fits one request)",
        )
    pinned = " or raise spec.memory.kvCacheMemoryBytes" if spec.memory.pinned else ""
    return make_decision(
        inp,
        "degrade",
        cur,
        trigger=T_KV_TOO_SMALL,
        reason="KVCacheTooSmall",
        message=f"{what} (rankguard's floor is {format_bytes(floor)}); to fix: {KNOBS}{pinned}",
        rank=t.rank,
        handled=keys,
    )


def rule_oom_killed(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    ks = [t for t in rel if t.kind == OOM_KILLED]
    if not ks:
        return None
    cur, spec = inp.current, inp.spec
    assert cur is not None
    keys = [t.key for t in ks]
    t = ks[0]
    # where the engine was when the kernel killed it (the agent's phase; None: unknown): said, and
    # kept in the history, but the lever is the memory limit whatever the phase
    killed = f"pod {t.pod_name} was OOMKilled" + (f" {PHASE_TEXT[t.phase]}" if t.phase in PHASE_TEXT else "")
    old = cur.memory_limit_bytes if cur.memory_limit_bytes is not None else spec.resources.memory_limit_bytes
    if old is None:
        return make_decision(
            inp,
            "degrade",
            cur,
            trigger=T_OOM_KILLED,
            reason="NoMemoryLimit",
            message=(
                f"{killed} without a container memory limit, so the node itself ran "
                "out of memory; set spec.resources.requests.memory and spec.resources.limits.memory so the "
                "scheduler reserves enough host memory"
            ),
            handled=keys,
            phase=t.phase,
        )
    ratio = spec.remediation.host_memory_bump_ratio
    bumped = max(old + VPA_MIN_BUMP_BYTES, math.ceil(old * ratio))
    new = -(-bumped // MiB) * MiB  # whole MiB: a readable quantity
    caps = [(c, n) for c, n in (
        (spec.remediation.max_host_memory_bytes, "spec.remediation.maxHostMemory"),
        (inp.node_memory_bytes, "the node's allocatable memory"),
    ) if c is not None]  # fmt: skip
    cap_note = ""
    if caps:
        cap, cap_name = min(caps, key=lambda c: c[0])
        if old >= cap:
            return make_decision(
                inp,
                "degrade",
                cur,
                trigger=T_OOM_KILLED,
                reason="MemoryLimitAtCap",
                message=(
                    f"{killed} at the container memory limit {format_bytes(old)}, which is "
                    f"already at the cap {format_bytes(cap)} ({cap_name}); raise "
                    f"spec.remediation.maxHostMemory (on "
                    "nodes with more memory), or lower host-memory use (spec.engine.maxNumSeqs, fewer "
                    "CPU-side caches)"
                ),
                handled=keys,
                phase=t.phase,
            )
        if new > cap:
            new, cap_note = cap, f", capped at {format_bytes(cap)} ({cap_name})"
    return make_decision(
        inp,
        "raise-memory-limit",
        cur.with_memory_limit(new),
        trigger=T_OOM_KILLED,
        reason=STATUS_ACTIONS["raise-memory-limit"],
        message=(
            f"{killed} at the container memory limit {format_bytes(old)}; "
            f"raising it to "
            f"{format_bytes(new)} (max(+100Mi, ×{ratio:g}), as the VPA does{cap_note})"
        ),
        handled=keys,
        phase=t.phase,
    )


def rule_rollout_failed(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    r = inp.rollout
    if r is None or not r.failed:
        return None
    cur, lkg = inp.current, inp.last_known_good
    assert cur is not None
    what = f"the rollout of {cur.describe()} did not finish ({r.reason}: {r.message})"
    if lkg is not None and lkg != cur:
        return make_decision(
            inp,
            "rollback",
            lkg,
            trigger=T_ROLLOUT_FAILED,
            reason=STATUS_ACTIONS["rollback"],
            message=f"{what}; rolling back to the last known good flags: {lkg.describe()}",
        )
    return make_decision(
        inp,
        "degrade",
        cur,
        trigger=T_ROLLOUT_FAILED,
        reason="RolloutFailed",
        message=(
            f"{what}, and there are no other known-good flags to roll back to; this is not a memory problem "
            "rankguard can fix: check the pods' events and logs (image, scheduling, GPUs, engine errors)"
        ),
    )


def engine_error_actionable(inp: PolicyInput, t: Termination) -> bool:
    """An engine error that a rollback may fix: flags changed since last-known-good, and the
    error happened after the latest change."""
    cur, lkg = inp.current, inp.last_known_good
    if lkg is None or lkg == cur:
        return False
    last = last_change(inp.history)
    return last is None or t.finished_at is None or t.finished_at >= last.time


def rule_engine_error(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    cur, lkg = inp.current, inp.last_known_good
    assert cur is not None
    errs = [t for t in rel if t.kind == ENGINE_ERROR and engine_error_actionable(inp, t)]
    if not errs or lkg is None:
        return None
    t = errs[0]
    return make_decision(
        inp,
        "rollback",
        lkg,
        trigger=T_ENGINE_ERROR,
        reason=STATUS_ACTIONS["rollback"],
        message=(
            f"{_ended(t)} after the change to {cur.describe()}; rolling back to the last known good "
            f"flags: {lkg.describe()}"
        ),
        rank=t.rank,
        handled=[x.key for x in errs],
    )


# The engine's last error line as quoted in a condition or an Event: enough for a Python
# exception and its message, short enough to read in `kubectl describe`.
ERROR_LINE_CHARS = 300
# vLLM's log prefix, `(EngineCore_DP0 pid=8238) ERROR 12-01 12:51:46 [core.py:779] `
_LOG_PREFIX = re.compile(
    r"^(\([^)]*\)\s+)?(ERROR|WARNING|INFO|CRITICAL)\s+\d\d-\d\d [\d:]{8}\s+\[[^\]]*\]\s*"
)
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b")


def last_error_line(message: str) -> str:
    """What the engine said last, bounded: its last two exception lines (vLLM ends a failed
    start with the root cause, then "Engine core initialization failed. See root cause
    above."), without log prefixes; else its last line. The agent joins lines with " | "."""
    parts = [_LOG_PREFIX.sub("", part).strip() for line in message.splitlines() for part in line.split(" | ")]
    parts = [p for p in parts if p]
    errors = [p for p in parts if _EXCEPTION.match(p)]
    line = " | ".join(errors[-2:] or parts[-1:]) or "no error line was recorded"
    return line if len(line) <= ERROR_LINE_CHARS else line[: ERROR_LINE_CHARS - 1] + "\u2026"


def _ended(t: Termination) -> str:
    """How the run ended, for a message: a SIGKILLed launcher as what it is (its log tail is only
    what it printed last), else the engine error with its exit code and words."""
    if t.sigkilled:
        return (
            f"vLLM's container in pod {t.pod_name} was {SIGKILLED}: something outside the engine "
            "killed it (not the kernel's OOM killer, which the kubelet names OOMKilled)"
        )
    return (
        f"vLLM exited with an engine error in pod {t.pod_name} (exit code {t.exit_code}: {t.message[:200]})"
    )


def rule_engine_crash_loop(inp: PolicyInput, rel: Sequence[Termination]) -> Decision | None:
    """Rule 5b: an engine error that no rollback can fix (nothing to roll back to, or the flags
    are the known good ones). The first one is said once (the pod restarts, it may pass); a
    repeat (a later run of the same pod, or two pods at once) is a crash loop: Degraded, with
    the engine's own last error line and what a person can change."""
    errs = [t for t in rel if t.kind == ENGINE_ERROR and not engine_error_actionable(inp, t)]
    if not errs:
        return None
    cur = inp.current
    assert cur is not None
    keys = [t.key for t in errs]
    t = max(errs, key=lambda x: (x.restart_count, x.finished_at or 0.0))
    line = last_error_line(t.message)
    code = "" if t.exit_code is None else f", exit code {t.exit_code}"
    said = (
        _ended(t) if t.sigkilled else f'vLLM exited with an engine error in pod {t.pod_name}{code}: "{line}"'
    )
    if t.restart_count < 1 and len(errs) < 2:
        return make_decision(
            inp,
            "none",
            cur,
            trigger=T_ENGINE_ERROR,
            reason="EngineError",
            message=(
                f"{said}; the pod restarts. If it fails again rankguard reports the service Degraded "
                "(EngineCrashLoop)"
            ),
            rank=t.rank,
            handled=keys,
        )
    runs = max(t.restart_count + 1, len(errs))
    lkg = inp.last_known_good
    why = (
        "there are no other known good flags to roll back to"
        if lkg is None or lkg == cur
        else "the error is not the latest change's (it came before it)"
    )
    looped = (
        f"vLLM keeps ending ({runs} runs ended; the last: its container in pod {t.pod_name} was {SIGKILLED})"
        if t.sigkilled
        else f'vLLM keeps exiting with an engine error ({runs} runs ended; pod {t.pod_name}{code}): "{line}"'
    )
    return make_decision(
        inp,
        "degrade",
        cur,
        trigger=T_ENGINE_ERROR,
        reason="EngineCrashLoop",
        message=(
            f"{looped}. This is not a memory failure rankguard can fix, and {why}; fix what the "
            "error names (spec.engine.extraArgs, spec.image, spec.model, or spec.template: env, "
            "secrets, volumes, node placement) and apply the change"
        ),
        rank=t.rank,
        handled=keys,
    )
