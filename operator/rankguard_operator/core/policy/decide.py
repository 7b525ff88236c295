"""`decide`: the rules in order, the first that applies wins, then the guard rails."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from rankguard_operator.core.budget.bounds import budget_key
from rankguard_operator.core.observe.pods import (
    ENGINE_ERROR,
    FAILURE_KINDS,
    Termination,
)
from rankguard_operator.core.policy.crash_rules import (
    engine_error_actionable,
    rule_cuda_oom,
    rule_engine_crash_loop,
    rule_engine_error,
    rule_engine_refused,
    rule_kv_too_small,
    rule_oom_killed,
    rule_rollout_failed,
)
from rankguard_operator.core.policy.decision import Decision, PolicyInput, make_decision, superseded
from rankguard_operator.core.policy.guard import guard
from rankguard_operator.core.policy.headroom_rules import (
    rule_headroom_worse,
    rule_low_headroom,
    rule_reclaim,
    rule_replan,
)
from rankguard_operator.core.policy.initial import initial_decision
from rankguard_operator.core.policy.measured import (
    measured_initial,
    pinned_start,
    rule_cuda_oom_measured,
    rule_kv_too_small_measured,
)
from rankguard_operator.core.policy.tunables import (
    LOW_HEADROOM_SUSTAIN_SECONDS,
    T_INITIAL,
    T_LOW_HEADROOM,
    T_SIZING_CHANGED,
    T_SPEC_CHANGED,
)
from rankguard_operator.core.units import format_bytes


def steady(inp: PolicyInput) -> Decision:
    cur = inp.current
    assert cur is not None
    obs = inp.observation
    b = obs.bottleneck if obs is not None else None
    minimum = inp.spec.memory.min_headroom_bytes
    if b is None:
        return make_decision(
            inp,
            "none",
            cur,
            trigger="NoData",
            reason="NoFreshData",
            message=f"no fresh agent report; running {cur.describe()}",
        )
    if b.min_free_bytes < minimum and inp.low_headroom_since is not None:
        return make_decision(
            inp,
            "none",
            cur,
            trigger=T_LOW_HEADROOM,
            reason="LowHeadroom",
            message=f"rank {b.rank} has {format_bytes(b.min_free_bytes)} headroom, below the minimum "
            f"{format_bytes(minimum)} for "
            f"{inp.now - inp.low_headroom_since:.0f}s; rankguard shrinks after "
            f"{LOW_HEADROOM_SUSTAIN_SECONDS:.0f}s",
            rank=b.rank,
        )
    return make_decision(
        inp,
        "none",
        cur,
        trigger="Steady",
        reason="Stable",
        message=f"running {cur.describe()}; bottleneck rank {b.rank} has "
        f"{format_bytes(b.min_free_bytes)} headroom "
        f"(minimum {format_bytes(minimum)})",
        rank=b.rank,
    )


RULES: tuple[Callable[[PolicyInput, Sequence[Termination]], Decision | None], ...] = (
    rule_engine_refused,
    rule_cuda_oom,
    rule_kv_too_small,
    rule_oom_killed,
    rule_rollout_failed,
    rule_engine_error,
    rule_engine_crash_loop,
    rule_headroom_worse,
    rule_low_headroom,
    rule_replan,
    rule_reclaim,
)


# An engine that measures its own KV cache (vLLM 0.34): its own OOM rules, no headroom rules
# (core/policy/measured.py says why)
MEASURED_RULES: tuple[Callable[[PolicyInput, Sequence[Termination]], Decision | None], ...] = (
    rule_engine_refused,
    rule_cuda_oom_measured,
    rule_kv_too_small_measured,
    rule_oom_killed,
    rule_rollout_failed,
    rule_engine_error,
    rule_engine_crash_loop,
)


def _first(inp: PolicyInput, trigger: str, measured: bool) -> Decision:
    return measured_initial(inp, trigger) if measured else initial_decision(inp, trigger)


def _mode_start(inp: PolicyInput, measured: bool) -> Decision:
    return measured_initial(inp, T_SIZING_CHANGED) if measured else pinned_start(inp, T_SIZING_CHANGED)


def _mode_changed(inp: PolicyInput, measured: bool) -> Decision:
    """The sizing mode moved (an image to or from 0.34, a node without VMM, a connector): the
    first flags of the new mode, said with why (one roll)."""
    d = _mode_start(inp, measured)
    sizing = inp.sizing
    assert sizing is not None
    # measured_initial's own message opens with the mode's: said once
    rest = d.message.removeprefix(sizing.message).lstrip("; ")
    return replace(
        d, reason=T_SIZING_CHANGED, message=f"sizing mode now {sizing.mode} ({sizing.message}); {rest}"
    )


def decide(inp: PolicyInput) -> Decision:
    """The one decision for this moment. Deterministic; see the module docstring for the rules."""
    cur = inp.current
    measured = inp.sizing is not None and inp.sizing.engine_measured
    if cur is None:
        return _first(inp, T_INITIAL, measured)
    if inp.sizing is not None and cur.engine_measured != measured:
        return _mode_changed(inp, measured)
    if inp.budget_key is not None and inp.budget_key != budget_key(inp.spec):
        return _first(inp, T_SPEC_CHANGED, measured)

    superseded_keys = [t.key for t in inp.new_terminations if superseded(t, cur)]
    rel = [t for t in inp.new_terminations if not superseded(t, cur)]
    # Normal stops (rollouts, scale-down) are only recorded as seen, and so are engine errors
    # that no rollback can fix (nothing changed since the flags were known good, or the error
    # came before the latest change), and refusals of the arguments (rule 0b reads them from
    # the rollout, on every pass while they last).
    ignorable = [
        t.key
        for t in rel
        if t.kind not in FAILURE_KINDS or (t.kind == ENGINE_ERROR and not engine_error_actionable(inp, t))
    ]

    decision: Decision | None = None
    for rule in MEASURED_RULES if measured else RULES:
        decision = rule(inp, rel)
        if decision is not None:
            break
    if decision is None:
        decision = steady(inp)
    decision = guard(inp, decision)
    handled = tuple(dict.fromkeys([*superseded_keys, *ignorable, *decision.handled]))
    return replace(decision, handled=handled)
