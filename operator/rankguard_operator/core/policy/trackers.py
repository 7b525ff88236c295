"""Trackers the caller keeps between decisions (pure: previous value in, next value out)."""

from __future__ import annotations

from collections.abc import Sequence

from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.headroom import Observation
from rankguard_operator.core.observe.pods import (
    ENGINE_REFUSED,
    FAILURE_KINDS,
    RolloutState,
    Termination,
)
from rankguard_operator.core.policy.tunables import (
    LOW_HEADROOM_SUSTAIN_SECONDS,
    RECLAIM_AFTER_SECONDS,
    RECLAIM_HEADROOM_FACTOR,
)
from rankguard_operator.core.spec.parse import ServiceSpec

# --------------------------------------------------------------------------------------------
# Trackers the caller keeps between calls (pure: previous value in, next value out)


def headroom_lines(spec: ServiceSpec) -> tuple[int, ...]:
    """The free memory (bytes) where a rank's minimum crossing changes what the trackers below
    say: the low-headroom line and the reclaim line. An agent's long-poll answers at once when a
    rank crosses one (edge/report_feed), and a status write is never held across one
    (core/status/hold)."""
    line = spec.memory.min_headroom_bytes
    return (line, RECLAIM_HEADROOM_FACTOR * line)


def headroom_due_in(low_since: float | None, ample_since: float | None, now: float) -> float | None:
    """Seconds until a stretch under way (low headroom, ample headroom) has lasted as long as its
    rule asks (the shrink, the reclaim): a pass is due then, whether or not an agent has news.
    None when no stretch falls due later (one already due had its pass; its rule's other checks
    are looked at again on the next pass)."""
    due = [
        since + wait - now
        for since, wait in ((low_since, LOW_HEADROOM_SUSTAIN_SECONDS), (ample_since, RECLAIM_AFTER_SECONDS))
        if since is not None and since + wait > now
    ]
    return min(due, default=None)


def track_low_headroom(
    prev_since: float | None, observation: Observation | None, spec: ServiceSpec, now: float
) -> float | None:
    """Since when the bottleneck has been below spec.memory.minHeadroomBytes. Stale or missing
    data neither starts nor ends the stretch (it is kept as it was)."""
    b = observation.bottleneck if observation is not None else None
    if b is None:
        return prev_since
    if b.min_free_bytes < spec.memory.min_headroom_bytes:
        return prev_since if prev_since is not None else now
    return None


def track_ample_headroom(
    prev_since: float | None, observation: Observation | None, spec: ServiceSpec, now: float
) -> float | None:
    """Since when every fresh rank has had >= RECLAIM_HEADROOM_FACTOR × minHeadroomBytes."""
    if observation is None or not observation.has_fresh_data:
        return prev_since
    threshold = RECLAIM_HEADROOM_FACTOR * spec.memory.min_headroom_bytes
    if all(r.min_free_bytes >= threshold for r in observation.fresh_ranks):
        return prev_since if prev_since is not None else now
    return None


def track_ample_lowest(
    prev_lowest: int | None, prev_since: float | None, since: float | None, observation: Observation | None
) -> int | None:
    """The least free memory the bottleneck rank has had during the current ample stretch
    (`since`, from track_ample_headroom): what reclaim fills up to. A new stretch starts it
    over; stale or missing data keeps it as it was."""
    if since is None:
        return None
    b = observation.bottleneck if observation is not None and observation.has_fresh_data else None
    if prev_since != since or prev_lowest is None:
        return None if b is None else b.min_free_bytes
    return prev_lowest if b is None else min(prev_lowest, b.min_free_bytes)


def next_last_known_good(
    prev: ServingFlags | None,
    current: ServingFlags | None,
    *,
    spec: ServiceSpec,
    rollout: RolloutState | None,
    observation: Observation | None,
    terminations: Sequence[Termination] = (),
) -> ServingFlags | None:
    """`current` becomes last-known-good once it has fully rolled out, fresh reports show every
    rank at or above the minimum headroom, and no memory or engine failure ran under it."""
    if current is None or rollout is None or not rollout.complete:
        return prev
    if observation is None:
        return prev
    b = observation.bottleneck
    if b is None or b.min_free_bytes < spec.memory.min_headroom_bytes:
        return prev
    for t in terminations:
        # (a refusal of the arguments is no failure of the flags, but these did not run either)
        if t.kind in (*FAILURE_KINDS, ENGINE_REFUSED) and (t.flags is None or t.flags == current):
            return prev
    return current
