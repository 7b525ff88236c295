"""Trackers the caller keeps between decisions (pure: previous value in, next value out)."""

from __future__ import annotations

from collections.abc import Sequence

from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.headroom import Observation
from rankguard_operator.core.observe.pods import (
    CUDA_OOM,
    ENGINE_ERROR,
    KV_CACHE_TOO_SMALL,
    OOM_KILLED,
    RolloutState,
    Termination,
)
from rankguard_operator.core.policy.tunables import RECLAIM_HEADROOM_FACTOR
from rankguard_operator.core.spec.parse import ServiceSpec

# --------------------------------------------------------------------------------------------
# Trackers the caller keeps between calls (pure: previous value in, next value out)


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
        if t.kind in (CUDA_OOM, KV_CACHE_TOO_SMALL, OOM_KILLED, ENGINE_ERROR) and (
            t.flags is None or t.flags == current
        ):
            return prev
    return current
