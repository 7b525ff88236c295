"""Guard rails on every flag change: remediation switched off, cooldown, changes per hour."""

from __future__ import annotations

from rankguard_operator.core.policy.decision import Decision, PolicyInput, last_change
from rankguard_operator.core.policy.tunables import (
    RATE_WINDOW_SECONDS,
    T_COOLDOWN,
    T_CUDA_OOM,
    T_DISABLED,
    T_OOM_KILLED,
    T_RATE_LIMIT,
)


def hold_decision(
    inp: PolicyInput, d: Decision, *, trigger: str, reason: str, why: str, retry: float | None
) -> Decision:
    return Decision(
        action="hold",
        flags=d.from_flags if d.from_flags is not None else d.flags,
        trigger=trigger,
        reason=reason,
        message=f"{why}; held: {d.message}",
        rank=d.rank,
        from_flags=d.from_flags,
        handled=(),
        retry_after=retry,
        held_action=d.action,
    )


def guard(inp: PolicyInput, d: Decision) -> Decision:
    if not d.changes_flags or d.action == "initial":
        return d
    rem = inp.spec.remediation
    if not rem.enabled:
        return hold_decision(
            inp,
            d,
            trigger=T_DISABLED,
            reason="RemediationDisabled",
            why="automatic remediation is off (spec.remediation.enabled: false), so rankguard only reports",
            retry=None,
        )
    if d.action == "rollback":
        return d  # returning to known flags is always allowed
    last = last_change(inp.history)
    # A crash under the very flags our last change produced means that change is failing now:
    # fixing it is not flapping, and the service is down meanwhile, so the cooldown does not
    # apply. The hourly limit still does.
    fixes_last_change = (
        d.trigger in (T_CUDA_OOM, T_OOM_KILLED) and last is not None and last.to_flags == inp.current
    )
    if last is not None and not fixes_last_change and inp.now - last.time < rem.cooldown_seconds:
        wait = last.time + rem.cooldown_seconds - inp.now
        return hold_decision(
            inp,
            d,
            trigger=T_COOLDOWN,
            reason="CooldownActive",
            why=(
                f"the last change was {inp.now - last.time:.0f}s ago, within the {rem.cooldown_seconds}s "
                f"cooldown (spec.remediation.cooldownSeconds); retrying in {wait:.0f}s"
            ),
            retry=wait,
        )
    recent = [h for h in inp.history if inp.now - h.time < RATE_WINDOW_SECONDS]
    if len(recent) >= rem.max_per_hour:
        wait = min(h.time for h in recent) + RATE_WINDOW_SECONDS - inp.now if recent else RATE_WINDOW_SECONDS
        return hold_decision(
            inp,
            d,
            trigger=T_RATE_LIMIT,
            reason="RateLimited",
            why=(
                f"{len(recent)} changes in the last hour reach spec.remediation.maxPerHour "
                f"({rem.max_per_hour}); retrying in {wait:.0f}s"
            ),
            retry=wait,
        )
    return d
