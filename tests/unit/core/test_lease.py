"""Leader election's decision (core/lease): take a free Lease, renew our own, wait out
someone else's by our own clock, never by theirs."""

from __future__ import annotations

from rankguard_operator.core.lease import LEASE_SECONDS, Observed, decide, micro_time, released

T0 = 1_800_000_000.0


def held_by(holder: str, renew: float = T0, transitions: int = 0, duration: int = LEASE_SECONDS) -> dict:
    return {
        "holderIdentity": holder,
        "renewTime": micro_time(renew),
        "acquireTime": micro_time(T0 - 100),
        "leaseDurationSeconds": duration,
        "leaseTransitions": transitions,
    }


def test_no_lease_is_created_with_us_as_holder() -> None:
    v = decide(None, "a", now=5.0, wall=T0, observed=None)
    assert v.action == "create" and v.holder == "a"
    assert v.spec["holderIdentity"] == "a" and v.spec["leaseTransitions"] == 0
    assert v.spec["renewTime"] == v.spec["acquireTime"] == micro_time(T0)


def test_our_own_lease_is_renewed_keeping_when_we_took_it() -> None:
    v = decide(held_by("a", transitions=3), "a", now=5.0, wall=T0 + 2, observed=None)
    assert v.action == "update" and v.holder == "a"
    assert v.spec["renewTime"] == micro_time(T0 + 2)
    assert v.spec["acquireTime"] == micro_time(T0 - 100) and v.spec["leaseTransitions"] == 3


def test_someone_elses_lease_is_waited_out_by_our_clock() -> None:
    lease = held_by("b", renew=T0 - 3600)  # their renewTime says an hour ago: clocks differ
    first = decide(lease, "a", now=100.0, wall=T0, observed=None)
    assert first.action == "wait" and first.holder == "b"  # we only just started watching it
    assert first.observed == Observed(("b", micro_time(T0 - 3600), 0), 100.0)
    still = decide(lease, "a", now=100.0 + LEASE_SECONDS - 0.1, wall=T0, observed=first.observed)
    assert still.action == "wait"
    taken = decide(lease, "a", now=100.0 + LEASE_SECONDS, wall=T0 + 15, observed=still.observed)
    assert taken.action == "update" and taken.holder == "a"
    assert taken.spec["leaseTransitions"] == 1 and taken.spec["acquireTime"] == micro_time(T0 + 15)


def test_a_renewal_restarts_the_wait() -> None:
    first = decide(held_by("b", renew=T0), "a", now=100.0, wall=T0, observed=None)
    renewed = held_by("b", renew=T0 + 2)
    later = decide(renewed, "a", now=100.0 + LEASE_SECONDS + 1, wall=T0, observed=first.observed)
    assert (
        later.action == "wait"
        and later.observed is not None
        and later.observed.at == 100.0 + LEASE_SECONDS + 1
    )


def test_the_holders_own_lease_duration_counts() -> None:
    first = decide(held_by("b", duration=40), "a", now=0.0, wall=T0, observed=None)
    assert decide(held_by("b", duration=40), "a", now=39.0, wall=T0, observed=first.observed).action == "wait"
    assert (
        decide(held_by("b", duration=40), "a", now=40.0, wall=T0, observed=first.observed).action == "update"
    )


def test_a_released_lease_is_taken_at_once() -> None:
    given = released(held_by("b"), "b", T0 + 1)
    assert given is not None and given["holderIdentity"] == ""
    v = decide(given, "a", now=0.0, wall=T0 + 1, observed=None)
    assert v.action == "update" and v.holder == "a"


def test_only_the_holder_releases() -> None:
    assert released(held_by("b"), "a", T0) is None
