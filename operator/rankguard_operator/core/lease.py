"""Leader election on a coordination.k8s.io Lease, as a pure decision: given the Lease as read,
who we are and our own clock, take it, renew it, or wait.

The rules are client-go's (tools/leaderelection), so a rankguard replica and anyone reading
the Lease agree on what it means:

- Nobody holds it (no Lease, an empty holder) -> take it.
- We hold it -> renew it.
- Someone else holds it -> wait until the record has not changed for `lease_seconds` *as
  measured by our own clock* since we first saw it that way. The holder's renewTime is not
  compared with our clock: clocks of two nodes may differ by more than a lease.

The holder gives up (and the process exits) when it has not renewed for `renew_deadline`,
which is shorter than the lease: by the time a standby takes over, the old leader has stopped
acting. Two operators therefore never act at once, even across a network partition.

Pure: no I/O; times come in as arguments.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

LEASE_SECONDS = 15  # how long a record must stay unchanged before a standby takes over
RENEW_DEADLINE = 10.0  # the holder gives up when it has not renewed for this long
RETRY_PERIOD = 2.0  # how often the holder renews and a standby looks


@dataclass(frozen=True)
class Observed:
    """The Lease's record as we last saw it change, and when (our monotonic clock)."""

    record: tuple[str, str, int]  # (holder, renewTime, leaseTransitions)
    at: float


@dataclass(frozen=True)
class Verdict:
    action: Literal["create", "update", "wait"]
    spec: Mapping[str, Any]  # the Lease spec to write (empty when waiting)
    observed: Observed | None
    holder: str  # who holds it after this verdict, as far as we know


def micro_time(ts: float) -> str:
    """A Lease's MicroTime (RFC 3339 with microseconds)."""
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _record(spec: Mapping[str, Any]) -> tuple[str, str, int]:
    transitions = spec.get("leaseTransitions")
    return (
        str(spec.get("holderIdentity") or ""),
        str(spec.get("renewTime") or ""),
        transitions if isinstance(transitions, int) else 0,
    )


def decide(
    lease_spec: Mapping[str, Any] | None,
    identity: str,
    *,
    now: float,
    wall: float,
    observed: Observed | None,
    lease_seconds: int = LEASE_SECONDS,
) -> Verdict:
    """What to do with the Lease as read (`None`: it does not exist). `now` is the monotonic
    clock (for expiry), `wall` the time written into the record."""
    stamp = micro_time(wall)
    mine = {"holderIdentity": identity, "leaseDurationSeconds": lease_seconds, "renewTime": stamp}
    if lease_spec is None:
        return Verdict("create", {**mine, "acquireTime": stamp, "leaseTransitions": 0}, None, identity)
    record = _record(lease_spec)
    if observed is None or observed.record != record:
        observed = Observed(record, now)  # it changed (or we just looked): its clock restarts
    holder, _, transitions = record
    if holder == identity:
        acquired = lease_spec.get("acquireTime") or stamp
        return Verdict(
            "update", {**mine, "acquireTime": acquired, "leaseTransitions": transitions}, observed, identity
        )
    duration = lease_spec.get("leaseDurationSeconds")
    duration = duration if isinstance(duration, int) and duration > 0 else lease_seconds
    if holder and now < observed.at + duration:
        return Verdict("wait", {}, observed, holder)
    # free, or its holder has not renewed for a whole lease: ours
    taken = {**mine, "acquireTime": stamp, "leaseTransitions": transitions + 1}
    return Verdict("update", taken, observed, identity)


def released(lease_spec: Mapping[str, Any], identity: str, wall: float) -> Mapping[str, Any] | None:
    """The spec that gives the Lease up on a clean shutdown (a standby takes it at once), or
    None when it is not ours to give."""
    if _record(lease_spec)[0] != identity:
        return None
    return {**lease_spec, "holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": micro_time(wall)}
