"""Which pods an LLMService trusts: only those its own Deployment's ReplicaSets made.

Before this rule, any pod carrying rankguard's labels was scraped and its termination message
acted upon: one forged pod cut a service's KV budget from 37.7 to 17.4 GiB. The step-level
test feeds such a pod to the pure step through the same filter the executor applies.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from reconcile_world import SETTINGS, crash_the_pod, running

from rankguard_operator.core.effects import ApplyDeployment, WriteIntent
from rankguard_operator.core.observe import ownership
from rankguard_operator.core.step import Step, reconcile

SERVICE_UID = "uid-1"  # reconcile_world's LLMService


def deployment(uid: str = "dep-1", owner: str = SERVICE_UID, kind: str = "LLMService") -> dict[str, Any]:
    return {
        "metadata": {
            "name": "svc",
            "uid": uid,
            "ownerReferences": [{"kind": kind, "uid": owner, "controller": True}],
        }
    }


def pod(name: str, rs: str | None, *, controller: bool = True, kind: str = "ReplicaSet") -> dict[str, Any]:
    refs = [] if rs is None else [{"kind": kind, "uid": rs, "controller": controller}]
    return {"metadata": {"name": name, "uid": f"uid-{name}", "ownerReferences": refs}}


RS_OWNERS = {"rs-1": "dep-1", "rs-old": "dep-1", "rs-other": "dep-2"}


def names(pods: Any) -> list[str]:
    return [p["metadata"]["name"] for p in pods]


def test_only_pods_of_the_services_own_replicasets_are_trusted() -> None:
    pods = [
        pod("real", "rs-1"),
        pod("previous-rollout", "rs-old"),
        pod("no-owner", None),
        pod("not-controller", "rs-1", controller=False),
        pod("owned-by-a-job", "rs-1", kind="Job"),
        pod("other-deployment", "rs-other"),
        pod("made-up-replicaset", "rs-nobody-knows"),
    ]
    trusted, ignored = ownership.trusted_pods(pods, RS_OWNERS, deployment(), SERVICE_UID)
    assert names(trusted) == ["real", "previous-rollout"]
    assert [(i.pod, i.reason) for i in ignored] == [
        ("no-owner", "no-owner"),
        ("not-controller", "no-owner"),
        ("owned-by-a-job", "no-owner"),
        ("other-deployment", "foreign-owner"),
        ("made-up-replicaset", "unknown-replicaset"),
    ]


def test_a_deployment_the_service_does_not_control_vouches_for_nothing() -> None:
    pods = [pod("real", "rs-1")]
    for dep in (
        None,
        deployment(owner="someone-else"),  # same name, re-created by a person
        deployment(kind="Job"),
        {"metadata": {"name": "svc", "uid": "dep-1"}},  # no ownerReferences at all
    ):
        trusted, ignored = ownership.trusted_pods(pods, RS_OWNERS, dep, SERVICE_UID)
        assert trusted == [] and [i.reason for i in ignored] == ["no-deployment"], dep


def test_a_forged_pods_cuda_oom_does_not_change_the_budget() -> None:
    """The step sees only what the filter passes: a forged pod's OOM termination is not acted
    upon, while the same termination on the service's own pod is (so the test can fail)."""
    c = running()
    kv_before = c.status["servingFlags"]
    assert c.deployment is not None
    c.deployment["metadata"]["uid"] = "dep-1"
    c.deployment["metadata"]["ownerReferences"] = [
        {"kind": "LLMService", "uid": SERVICE_UID, "controller": True}
    ]
    crash_the_pod(c)
    forged = copy.deepcopy(c.pods[0])
    forged["metadata"].update(name="forged", uid="uid-forged", ownerReferences=[])
    real = c.pods[0]
    real["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "uid": "rs-1", "controller": True}]

    def step_with(pods: list[dict[str, Any]]) -> Step:
        trusted, _ = ownership.trusted_pods(pods, RS_OWNERS, c.deployment, SERVICE_UID)
        return reconcile.step(c.state(), replace(c.world(), pods=trusted), SETTINGS)

    forged_only = step_with([forged])
    assert not any(isinstance(e, ApplyDeployment) for e in forged_only.effects)
    assert forged_only.state.raw.get("servingFlags") == kv_before
    acted = step_with([real])
    assert any(isinstance(e, WriteIntent) for e in acted.effects)
