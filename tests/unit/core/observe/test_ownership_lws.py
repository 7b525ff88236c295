"""The owner chain of a LeaderWorkerSet's pods (issue 50, point 2): LLMService -> LeaderWorkerSet
-> leader StatefulSet -> leader pod -> worker StatefulSet -> worker pods, each link as LWS's
controller (kubernetes-sigs/lws v0.9.0 `pkg/controllers`) sets it, and each pod as LWS's pod
webhook admits it. The objects here are built the way that controller builds them; the cluster
tier (tests/cluster/test_lws_controller.py) runs the controller itself on rankguard's render.
Before this, every pod of such a service was `foreign-owner`.
"""

from __future__ import annotations

import copy
from typing import Any

from rankguard_operator.core.observe import ownership
from rankguard_operator.core.observe.groups import live_groups
from rankguard_operator.core.step.trust import Memory, trust
from tests.builders import owned, owner_ref
from tests.unit.core.observe.test_ownership import OLD_TEMPLATE, SERVICE_UID, TEMPLATE, reasons, tags

NS = "serving"
LWS = "svc"
SIZE = 2


def leader_worker_set(owner_uid: str = SERVICE_UID, *, policy: str = "UniquePerReplica") -> dict[str, Any]:
    lws = owned(
        LWS,
        "lws-1",
        owner_ref("LLMService", owner_uid),
        spec={
            "replicas": 2,
            "leaderWorkerTemplate": {"size": SIZE},
            "networkConfig": {"subdomainPolicy": policy},
        },
    )
    lws["metadata"]["namespace"] = NS
    return lws


def lws_set(name: str, uid: str, owner: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    s = owned(name, uid, owner, spec={"replicas": 2, "template": {"spec": copy.deepcopy(TEMPLATE)}})
    s["metadata"]["labels"] = labels
    return s


NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LEADER_SET = lws_set(LWS, "lset", owner_ref("LeaderWorkerSet", "lws-1"), {NAME_LABEL: LWS})


def admitted(group: int, worker: int, subdomain: str | None = None) -> dict[str, Any]:
    """The pod spec LWS's webhook admits: its three variables first in every container."""
    spec = copy.deepcopy(TEMPLATE)
    env = [
        {"name": "LWS_LEADER_ADDRESS", "value": f"{LWS}-{group}.{subdomain or f'{LWS}-{group}'}.{NS}"},
        {"name": "LWS_GROUP_SIZE", "value": str(SIZE)},
        {"name": "LWS_WORKER_INDEX", "value": str(worker)},
    ]
    for c in [*spec["containers"], *spec.get("initContainers", [])]:
        c["env"] = [*env, *c.get("env", [])]
    return spec


def lws_pod(
    name: str, uid: str, set_uid: str, group: int, worker: int, *, spec: Any = None
) -> dict[str, Any]:
    p = owned(name, uid, owner_ref("StatefulSet", set_uid), spec=spec or admitted(group, worker))
    p["metadata"]["labels"] = {
        "rankguard.io/role": "leader" if worker == 0 else "worker",
        "leaderworkerset.sigs.k8s.io/name": LWS,
        "leaderworkerset.sigs.k8s.io/group-index": str(group),
        "leaderworkerset.sigs.k8s.io/worker-index": str(worker),
    }
    return p


def world() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two groups of two: sets and pods as LWS's controller makes them."""
    sets, pods = [LEADER_SET], []
    for g in range(2):
        leader = lws_pod(f"{LWS}-{g}", f"uid-leader-{g}", "lset", g, 0)
        labels = {NAME_LABEL: LWS, "leaderworkerset.sigs.k8s.io/group-index": str(g)}
        sets.append(lws_set(f"{LWS}-{g}", f"wset-{g}", owner_ref("Pod", f"uid-leader-{g}"), labels))
        pods += [leader, lws_pod(f"{LWS}-{g}-1", f"uid-worker-{g}", f"wset-{g}", g, 1)]
    return sets, pods


def test_every_pod_of_a_leaderworkerset_is_trusted_through_the_chain() -> None:
    sets, pods = world()
    trusted, ignored = ownership.trusted_pods(
        pods, {}, None, SERVICE_UID, statefulsets=sets, leader_worker_set=leader_worker_set()
    )
    assert tags(trusted) == ["leader-0", "worker-0", "leader-1", "worker-1"] and ignored == []
    owned_sets = ownership.owned_statefulsets(
        sets, SERVICE_UID, leader_worker_set=leader_worker_set(), pods=trusted
    )
    assert [s["metadata"]["uid"] for s in owned_sets] == ["lset", "wset-0", "wset-1"]


def test_without_the_lws_in_the_chain_every_pod_is_foreign_as_before() -> None:
    """What issue 50 saw: no LWS handed in (or one another service controls), nothing counts."""
    sets, pods = world()
    for lws in (None, leader_worker_set("someone-else")):
        trusted, ignored = ownership.trusted_pods(
            pods, {}, None, SERVICE_UID, statefulsets=sets, leader_worker_set=lws
        )
        assert trusted == [] and {i.reason for i in ignored} == {"foreign-owner"}


def test_each_link_is_checked() -> None:
    sets, pods = world()
    lws = leader_worker_set()
    # a leader set of another name, or another LWS's: its pods do not count
    renamed = [{**LEADER_SET, "metadata": {**LEADER_SET["metadata"], "name": "other"}}, *sets[1:]]
    trusted, _ = ownership.trusted_pods(
        pods, {}, None, SERVICE_UID, statefulsets=renamed, leader_worker_set=lws
    )
    assert tags(trusted) == []
    # a worker set under a pod that is not a trusted leader (a forged pod of the leader's name)
    forged_leader = lws_pod(f"{LWS}-0", "uid-forged", "lset", 0, 0, spec={"containers": []})
    wset = lws_set(f"{LWS}-0", "wset-f", owner_ref("Pod", "uid-forged"), {})
    worker = lws_pod(f"{LWS}-0-1", "uid-w", "wset-f", 0, 1)
    trusted, ignored = ownership.trusted_pods(
        [forged_leader, worker], {}, None, SERVICE_UID, statefulsets=[LEADER_SET, wset], leader_worker_set=lws
    )
    assert trusted == [] and reasons(ignored) == [("forged", "not-from-template"), ("w", "foreign-owner")]
    # a worker set whose name is not its leader pod's
    misnamed = lws_set(f"{LWS}-1", "wset-m", owner_ref("Pod", "uid-leader-0"), {})
    worker = lws_pod(f"{LWS}-1-1", "uid-w", "wset-m", 1, 1)
    trusted, ignored = ownership.trusted_pods(
        [pods[0], worker], {}, None, SERVICE_UID, statefulsets=[LEADER_SET, misnamed], leader_worker_set=lws
    )
    assert tags(trusted) == ["leader-0"] and reasons(ignored) == [("w", "foreign-owner")]


def test_a_pod_is_what_lws_admits_from_its_sets_template() -> None:
    sets, pods = world()
    lws = leader_worker_set()
    cases = [
        lws_pod(f"{LWS}-0-1", "uid-bare", "wset-0", 0, 1, spec=copy.deepcopy(TEMPLATE)),  # not admitted
        lws_pod(f"{LWS}-0-1", "uid-rank", "wset-0", 0, 1, spec=admitted(0, 3)),  # another rank's variables
        lws_pod(f"{LWS}-0-1", "uid-addr", "wset-0", 0, 1, spec=admitted(1, 1)),  # another leader
        lws_pod(f"{LWS}-0-0", "uid-ord0", "wset-0", 0, 0, spec=admitted(0, 0)),  # a worker set starts at 1
        lws_pod(f"{LWS}-x", "uid-name", "lset", 0, 0),
    ]
    trusted, ignored = ownership.trusted_pods(
        pods[:1] + cases, {}, None, SERVICE_UID, statefulsets=sets, leader_worker_set=lws
    )
    assert tags(trusted) == ["leader-0"]
    assert reasons(ignored) == [
        ("bare", "not-from-template"),
        ("rank", "not-from-template"),
        ("addr", "not-from-template"),
        ("ord0", "wrong-name"),
        ("name", "wrong-name"),
    ]


def test_a_shared_subdomain_names_the_lws_service_in_the_leader_address() -> None:
    lws = leader_worker_set(policy="Shared")
    leader = lws_pod(f"{LWS}-0", "uid-leader-0", "lset", 0, 0, spec=admitted(0, 0, subdomain=LWS))
    trusted, _ = ownership.trusted_pods(
        [leader], {}, None, SERVICE_UID, statefulsets=[LEADER_SET], leader_worker_set=lws
    )
    assert tags(trusted) == ["leader-0"]


def test_trust_hands_the_lws_sets_on_and_groups_read_lws_labels() -> None:
    sets, pods = world()
    got = trust(
        pods,
        {},
        None,
        SERVICE_UID,
        statefulsets=sets,
        memory=Memory(),
        now=0.0,
        leader_worker_set=leader_worker_set(),
    )
    assert len(got.pods) == 4 and [s["metadata"]["uid"] for s in got.statefulsets] == [
        "lset",
        "wset-0",
        "wset-1",
    ]
    groups = live_groups(got.statefulsets, got.pods, SIZE)
    assert sorted(groups.by_index) == [0, 1]
    for g in (0, 1):
        group = groups.get(g)
        assert group is not None and group.leader is LEADER_SET
        assert group.workers is not None and group.workers["metadata"]["uid"] == f"wset-{g}"
        assert sorted(p["metadata"]["name"] for p in group.pods) == [f"{LWS}-{g}", f"{LWS}-{g}-1"]


def test_while_lws_rolls_a_set_its_old_pods_count_by_the_template_it_carried_before() -> None:
    """LWS changes the leader set's template and replaces its pods one group at a time: the old
    group's leader, admitted from the earlier template, still counts (seen in the e2e tier: the
    roll of a remediation left the not-yet-rolled leader `not-from-template`)."""
    sets, pods = world()
    lws = leader_worker_set()
    first = trust(
        pods, {}, None, SERVICE_UID, statefulsets=sets, memory=Memory(), now=0.0, leader_worker_set=lws
    )
    assert len(first.pods) == 4
    rolled = copy.deepcopy(LEADER_SET)
    rolled["spec"]["template"]["spec"] = copy.deepcopy(OLD_TEMPLATE)  # any other template
    later = [rolled, *sets[1:]]
    kept = trust(
        pods, {}, None, SERVICE_UID, statefulsets=later, memory=first.memory, now=1.0, leader_worker_set=lws
    )
    assert tags(kept.pods) == ["leader-0", "worker-0", "leader-1", "worker-1"]
    # without that memory (an operator restart) the old leaders wait for their roll
    fresh = trust(
        pods, {}, None, SERVICE_UID, statefulsets=later, memory=Memory(), now=1.0, leader_worker_set=lws
    )
    assert tags(fresh.pods) == []
