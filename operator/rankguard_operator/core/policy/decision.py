"""The policy's input and output, and the small helpers every rule uses to build a decision."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.sizing_mode import SizingMode
from rankguard_operator.core.observe.headroom import Observation
from rankguard_operator.core.observe.outside_memory import Outside
from rankguard_operator.core.observe.pods import CUDA_OOM, OOM_KILLED, RolloutState, Termination
from rankguard_operator.core.policy.history import Remediation
from rankguard_operator.core.spec.parse import ServiceSpec

Action = Literal[
    "none",
    "initial",
    "shrink",
    "raise-memory-limit",
    "grow",
    "rollback",
    "degrade",
    "hold",
    "replan",
    # the OOM levers other than the KV budget (core/policy/oom_levers.py)
    "lower-batched-tokens",
    "lower-num-seqs",
    "lower-capture-size",
    "enforce-eager",
    # an engine that measures its own KV cache (core/policy/measured.py)
    "raise-reserve",
    "pin-budget",
]

# --------------------------------------------------------------------------------------------
# Input and output


@dataclass(frozen=True)
class PolicyInput:
    spec: ServiceSpec
    now: float
    current: ServingFlags | None = None  # what the Deployment runs; None before the first render
    last_known_good: ServingFlags | None = None
    observation: Observation | None = None  # reports of pods running the current template
    new_terminations: Sequence[Termination] = ()  # not yet handled (the caller dedups by key)
    rollout: RolloutState | None = None
    history: Sequence[Remediation] = ()
    plan: Plan | None = None  # budget.bounds.initial_plan(spec, measured=...) or None
    prior: Plan | None = None  # the plan from priors (a fresh start's); None: as `plan`
    low_headroom_since: float | None = None  # track_low_headroom
    ample_headroom_since: float | None = None  # track_ample_headroom
    ample_headroom_lowest: int | None = None  # track_ample_lowest: the stretch's least free bytes
    budget_key: str | None = None  # budget.bounds.budget_key(spec) when `current` was chosen; None: unknown
    node_memory_bytes: int | None = None  # the node's allocatable memory, a cap for raising the limit
    sizing: SizingMode | None = None  # who sizes the KV cache (None: rankguard, as before vLLM 0.34)
    outside: Outside | None = None  # what the engine cannot see (core/observe/outside_memory.py)


@dataclass(frozen=True)
class Decision:
    action: Action
    flags: ServingFlags  # the flags to run after this decision
    trigger: str
    reason: str  # CamelCase, for Events and Conditions
    message: str  # a sentence with the numbers, naming the knob when rankguard cannot fix it
    rank: int | None = None
    from_flags: ServingFlags | None = None  # the flags before (inp.current)
    handled: tuple[str, ...] = ()  # termination keys this decision accounts for
    retry_after: float | None = None  # seconds until a held action may go ahead
    held_action: str | None = None  # for "hold": what would have been done
    phase: str | None = None  # the engine phase of the CUDA OOM this answers (None: unknown / no OOM)
    lever: str | None = None  # the OOM lever moved (oom_levers.LEVERS), None for other changes
    lever_from: int | bool | None = None  # that lever's value before (the spec's when no flag set it)

    @property
    def changes_flags(self) -> bool:
        return self.flags != self.from_flags

    @property
    def is_remediation(self) -> bool:
        """A flag change rankguard made on its own (goes into the history, counts for cooldown)."""
        return self.changes_flags and self.action not in ("initial", "hold", "none")

    def remediation(self, time: float, revision: str | int | None = None) -> Remediation:
        return Remediation(
            time=time,
            trigger=self.trigger,
            action=self.action,
            rank=self.rank,
            from_flags=self.from_flags,
            to_flags=self.flags,
            revision=revision,
            message=self.message,
            phase=self.phase,
            lever=self.lever,
            lever_from=self.lever_from,
        )


# --------------------------------------------------------------------------------------------
# Helpers


def same_budget(a: ServingFlags, b: ServingFlags) -> bool:
    return (
        a.kv_cache_memory_bytes == b.kv_cache_memory_bytes
        and a.gpu_memory_utilization == b.gpu_memory_utilization
        and a.engine_measured == b.engine_measured
    )


def same_gpu_flags(a: ServingFlags, b: ServingFlags) -> bool:
    """The same GPU-memory flags: the KV budget and every OOM lever."""
    return same_budget(a, b) and a.levers() == b.levers()


def superseded(t: Termination, current: ServingFlags) -> bool:
    """The pod ran other flags than the current ones in the dimension this failure is about (a
    CUDA OOM: the budget or any OOM lever, since each of them moves GPU memory)."""
    if t.flags is None:
        return False
    if t.kind == OOM_KILLED:
        return t.flags.memory_limit_bytes != current.memory_limit_bytes
    if t.kind == CUDA_OOM:
        return not same_gpu_flags(t.flags, current)
    return not same_budget(t.flags, current)


def rank_text(rank: int | None) -> str:
    return f"rank {rank}" if rank is not None else "a rank"


def make_decision(
    inp: PolicyInput,
    action: Action,
    flags: ServingFlags,
    *,
    trigger: str,
    reason: str,
    message: str,
    rank: int | None = None,
    handled: Sequence[str] = (),
    phase: str | None = None,
    lever: str | None = None,
    lever_from: int | bool | None = None,
) -> Decision:
    return Decision(
        action=action,
        flags=flags,
        trigger=trigger,
        reason=reason,
        message=message,
        rank=rank,
        from_flags=inp.current,
        handled=tuple(handled),
        phase=phase,
        lever=lever,
        lever_from=lever_from,
    )


def last_change(history: Sequence[Remediation]) -> Remediation | None:
    return max(history, key=lambda h: h.time) if history else None
