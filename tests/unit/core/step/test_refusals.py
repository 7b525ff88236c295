"""core/step/refusals: a refused name (NameTaken) scales the service's own workload to zero,
even while it serves (issue 50: both created in the same second, the younger one's pod had
started before the refusal and stayed an endpoint of the older one's Service for minutes),
and touches nothing it does not control."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from rankguard_operator.core.conditions import condition
from rankguard_operator.core.effects import ApplyDeployment, ApplyObject, ApplyService
from rankguard_operator.core.render.taken_names import LABEL, Holder, NameRivals, Rival
from rankguard_operator.core.step import World
from tests.unit.reconcile_world import Cluster

EARLY, LATE = "2027-01-01T00:00:00Z", "2027-01-02T00:00:00Z"
RIVAL = NameRivals(LATE, (Rival(LABEL, "svc", Holder("svc-older", "uid-2", EARLY)),))


class Named(Cluster):
    rivals: NameRivals | None = None

    def world(self, *a: Any, **kw: Any) -> World:
        return replace(super().world(*a, **kw), name_rivals=self.rivals)


def serving() -> Named:
    c = Named()
    c.run()
    c.controller_done()
    c.run()
    assert c.deployment is not None and c.deployment["status"]["readyReplicas"] == 1
    return c


def test_a_refused_name_scales_its_own_serving_deployment_to_zero_and_back() -> None:
    c = serving()
    replicas = c.deployment["spec"]["replicas"] if c.deployment else None
    c.rivals = RIVAL  # the older service's name is seen only now
    step = c.run()
    [scaled] = [e for e in step.effects if isinstance(e, ApplyDeployment)]
    assert scaled.body["spec"]["replicas"] == 0
    # the same template: no rollout, only the scale
    assert c.deployment is not None and c.deployment["spec"]["replicas"] == 0
    assert not [e for e in step.effects if isinstance(e, (ApplyService, ApplyObject))]
    d = dict(condition(c.status["conditions"], "Degraded") or {})
    assert (d["status"], d["reason"]) == ("True", "NameTaken")
    assert "scaled its own workload to zero replicas" in d["message"], d["message"]
    # at zero it stays there, and nothing more is applied
    again = c.run()
    assert not [e for e in again.effects if isinstance(e, (ApplyDeployment, ApplyService, ApplyObject))]

    # the name is free again: the next pass renders the spec's replicas
    c.rivals = NameRivals(LATE)
    back = c.run()
    assert [e.body["spec"]["replicas"] for e in back.effects if isinstance(e, ApplyDeployment)] == [replicas]


def test_a_deployment_another_service_controls_is_left_alone() -> None:
    c = serving()
    assert c.deployment is not None
    theirs = copy.deepcopy(c.deployment)
    for ref in theirs["metadata"]["ownerReferences"]:
        ref["uid"] = "uid-2"  # the older service's, by UID
    c.deployment = theirs
    c.rivals = RIVAL
    step = c.run()
    assert not [e for e in step.effects if isinstance(e, (ApplyDeployment, ApplyObject))]
    assert c.deployment["spec"]["replicas"] == 1
