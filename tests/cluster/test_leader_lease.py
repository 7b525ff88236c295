"""Leader election (edge/leader) on a real API server's coordination.k8s.io Lease: one holder
at a time, a standby that waits the holder out, a clean hand-over on release, and a holder
that stops at once when someone else holds its Lease."""

from __future__ import annotations

import threading

from kubernetes import client

from rankguard_operator.edge.leader import LeaderElector, LeaseClient, Timing
from rankguard_sim.waiting import wait_for

FAST = Timing(lease_seconds=3, renew_deadline=2.0, retry_period=0.2)


def elector(api: client.ApiClient, namespace: str, who: str) -> LeaderElector:
    return LeaderElector(LeaseClient(api, namespace, "rg-lease"), who, FAST)


def holder(api: client.ApiClient, namespace: str) -> str:
    lease = client.CoordinationV1Api(api).read_namespaced_lease("rg-lease", namespace)
    return str(lease.spec.holder_identity or "")


def test_one_holder_and_a_clean_hand_over(api: client.ApiClient, namespace: str) -> None:
    a, b = elector(api, namespace, "a"), elector(api, namespace, "b")
    assert a.try_once()  # creates the Lease
    assert not b.try_once()  # held and fresh: b waits
    assert a.try_once() and not b.try_once()  # a renews; b still waits
    assert holder(api, namespace) == "a"
    a.release()
    assert holder(api, namespace) == ""
    assert b.try_once() and holder(api, namespace) == "b"  # taken at once, no lease to wait out
    lease = client.CoordinationV1Api(api).read_namespaced_lease("rg-lease", namespace)
    assert lease.spec.lease_transitions == 1


def test_a_standby_takes_over_a_lease_nobody_renews(api: client.ApiClient, namespace: str) -> None:
    a, b = elector(api, namespace, "a"), elector(api, namespace, "b")
    assert a.try_once()  # and then a dies: nobody renews
    assert not b.try_once()
    wait_for("b to take the stale Lease", b.try_once, 30, every=0.2)
    assert holder(api, namespace) == "b"


def test_a_holder_that_loses_its_lease_stops(api: client.ApiClient, namespace: str) -> None:
    a = elector(api, namespace, "a")
    a.acquire()
    lost: list[str] = []
    done = threading.Event()

    def on_lost(why: str) -> None:
        lost.append(why)
        done.set()

    a.keep(on_lost)
    # someone else writes the Lease as its holder (a partition healed the wrong way round)
    leases = LeaseClient(api, namespace, "rg-lease")
    spec, rv = leases.read()
    assert spec is not None
    assert leases.write({**spec, "holderIdentity": "b"}, rv)
    wait_for("a to notice", done.is_set, 30)
    assert "held by b" in lost[0]
    assert holder(api, namespace) == "b"  # a did not take it back


def test_a_write_that_lost_the_race_is_refused(api: client.ApiClient, namespace: str) -> None:
    leases = LeaseClient(api, namespace, "rg-lease")
    assert leases.write({"holderIdentity": "a", "leaseDurationSeconds": 3}, None)
    spec, rv = leases.read()
    assert spec is not None and rv
    assert leases.write({**spec, "holderIdentity": "b"}, rv)
    assert not leases.write({**spec, "holderIdentity": "c"}, rv)  # rv is now old: 409
    assert not leases.write({**spec, "holderIdentity": "c"}, None)  # it exists: 409 too
    assert holder(api, namespace) == "b"
