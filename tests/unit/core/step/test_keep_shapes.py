"""A running service that changes shape (one pod, StatefulSet groups, a LeaderWorkerSet) deletes
what its old shape applied, before the new shape's applies in the same pass, and only what this
LLMService controls; a LeaderWorkerSet gone (deleted by hand) is applied again. On the in-memory
cluster of tests/unit/core/step/group_world, the LeaderWorkerSet seen as the edge reads it."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from rankguard_operator.core.effects import ApplyDeployment, ApplyObject, DeleteObject, Effect
from rankguard_operator.core.names import LWS_KIND
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import ReportInput, World, reads_leader_worker_set

from .group_world import SPEC, GroupCluster


@dataclasses.dataclass
class ShapeCluster(GroupCluster):
    """GroupCluster whose world carries the LeaderWorkerSet when the edge would read it."""

    def world(self, reports: tuple[ReportInput, ...] = ()) -> World:
        w = super().world(reports)
        lws = next(iter(self.of_kind(LWS_KIND)), None)
        if lws is None or not reads_leader_worker_set(self.spec, self.state()):
            return w
        return dataclasses.replace(
            w, leader_worker_set={**lws, "metadata": {**lws["metadata"], "uid": "uid-lws"}}
        )

    def reshape(self, spec: dict[str, Any]) -> list[Effect]:
        self.spec = spec
        self.generation += 1
        return list(self.run().effects)


def single() -> dict[str, Any]:
    doc = copy.deepcopy(SPEC)
    del doc["distributed"]
    return doc


def on_lws() -> dict[str, Any]:
    doc = copy.deepcopy(SPEC)
    doc["distributed"] = {**doc["distributed"], "workload": "LeaderWorkerSet"}
    return doc


def deletes(effects: list[Effect]) -> list[tuple[str, str]]:
    return sorted((e.kind, e.name) for e in effects if isinstance(e, DeleteObject))


def applies_after_deletes(effects: list[Effect]) -> bool:
    kinds = [
        isinstance(e, DeleteObject)
        for e in effects
        if isinstance(e, (DeleteObject, ApplyObject, ApplyDeployment))
    ]
    return kinds == sorted(kinds, reverse=True)  # every delete before every apply


def test_statefulsets_to_a_leader_worker_set_deletes_the_groups_first() -> None:
    c = ShapeCluster()
    c.settle()
    assert len(c.of_kind("StatefulSet")) == 4
    effects = c.reshape(on_lws())
    assert deletes(effects) == [
        ("Service", "svc-nodes"),
        ("StatefulSet", "svc-g0"),
        ("StatefulSet", "svc-g0-w"),
        ("StatefulSet", "svc-g1"),
        ("StatefulSet", "svc-g1-w"),
    ]
    assert [e.body["kind"] for e in effects if isinstance(e, ApplyObject)] == [LWS_KIND]
    assert applies_after_deletes(effects)
    assert c.of_kind("StatefulSet") == [] and len(c.of_kind(LWS_KIND)) == 1


def test_a_set_another_controller_made_is_never_deleted() -> None:
    c = ShapeCluster(spec=on_lws())
    c.run()
    # a StatefulSet LWS's controller made for the service's groups (its controller: the LWS)
    theirs = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": "svc",
            "namespace": "ns",
            "uid": "uid-leaders",
            "ownerReferences": [{"kind": LWS_KIND, "name": "svc", "uid": "uid-lws", "controller": True}],
        },
        "spec": {"replicas": 2, "template": {"metadata": {}, "spec": {}}},
    }
    w = dataclasses.replace(c.world(), statefulsets=[theirs])
    from rankguard_operator.core.step import reconcile

    from .group_world import SETTINGS

    step = reconcile.step(c.state(), w, SETTINGS)
    assert deletes(list(step.effects)) == []


def test_a_leader_worker_set_to_statefulsets_or_one_pod_deletes_it_then_forgets_it() -> None:
    for target in (copy.deepcopy(SPEC), single()):
        c = ShapeCluster(spec=on_lws())
        c.settle(passes=3)
        assert len(c.of_kind(LWS_KIND)) == 1 and c.status.get("workloadHash")
        effects = c.reshape(target)
        assert (LWS_KIND, "svc") in deletes(effects)
        assert applies_after_deletes(effects)
        assert c.of_kind(LWS_KIND) == []
        c.run()  # the LeaderWorkerSet is gone: status stops recording it, the edge stops reading it
        assert "workloadHash" not in c.status
        assert not reads_leader_worker_set(c.spec, c.state())


def test_one_pod_to_groups_and_back_frees_the_old_shape_first() -> None:
    c = ShapeCluster(spec=single())
    c.run()
    assert c.deployment is not None
    effects = c.reshape(copy.deepcopy(SPEC))
    assert deletes(effects) == [("Deployment", "svc")] and applies_after_deletes(effects)
    c.settle()
    effects = c.reshape(single())
    assert ("Service", "svc-nodes") in deletes(effects) and applies_after_deletes(effects)


def test_a_leader_worker_set_deleted_by_hand_is_applied_again() -> None:
    c = ShapeCluster(spec=on_lws())
    c.settle(passes=3)
    quiet = c.run()
    assert not [e for e in quiet.effects if isinstance(e, ApplyObject)]  # applied once, not every pass
    c.objects.pop((LWS_KIND, "svc"))
    again = c.run()
    assert [e.body["kind"] for e in again.effects if isinstance(e, ApplyObject)] == [LWS_KIND]


def test_the_edge_reads_the_leader_worker_set_while_wanted_or_recorded() -> None:
    none = ServiceState.from_status({})
    assert reads_leader_worker_set(on_lws(), none)
    assert not reads_leader_worker_set(SPEC, none)
    assert reads_leader_worker_set(SPEC, ServiceState.from_status({"workloadHash": "abc"}))
