"""spec.modelCache through `reconcile.step`: the claim rankguard creates (ApplyClaim, before the
Deployment, on the first pass, after a spec change and when it went missing), the
ModelCacheReady condition for each state of the claim, one Event per change of reason, and a
missing claim that stops nothing."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from rankguard_operator.core.conditions import condition
from rankguard_operator.core.effects import ApplyClaim
from rankguard_operator.core.names import cache_claim_name
from rankguard_operator.core.render.claim import claim_to_apply
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.step import Step, needs, reconcile
from tests.unit.reconcile_world import SETTINGS, Cluster


class CacheCluster(Cluster):
    """The in-memory cluster with the claim handed to each pass; a claim the step creates is
    Pending until a test binds it (as its provisioner would)."""

    def step(self) -> Step:
        world = replace(self.world(), cache_claim=copy.deepcopy(self.claim))
        step = reconcile.step(self.state(), world, SETTINGS)
        for effect in step.effects:
            self.carry_out(effect)
            if isinstance(effect, ApplyClaim):
                self.claim = {**(self.claim or {}), "status": {"phase": "Pending"}}
        self.clock += 2.0
        return step

    @property
    def claims_applied(self) -> list[dict[str, Any]]:
        return [b for b in self.applied if b["kind"] == "PersistentVolumeClaim"]

    def cache(self) -> dict[str, Any]:
        return dict(condition(self.status["conditions"], "ModelCacheReady") or {})

    def event_reasons(self) -> list[str]:
        return [e.reason for e in self.events.values()]


def cluster(**cache: Any) -> CacheCluster:
    c = CacheCluster()
    c.spec["modelCache"] = cache
    return c


def bound(claim: dict[str, Any], volume: str = "pv-1") -> dict[str, Any]:
    return {
        **claim,
        "spec": {**claim.get("spec", {}), "volumeName": volume},
        "status": {"phase": "Bound", "capacity": {"storage": "200Gi"}},
    }


def user_claim(name: str, phase: str = "Pending", storage_class: str | None = "fast") -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"]}
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec, "status": {"phase": phase}}


# --------------------------------------------------------------------------------------------
# A claim the user names


def test_a_missing_named_claim_says_how_to_fix_it_once_and_stops_nothing() -> None:
    c = cluster(claimName="weights")
    for _ in range(4):
        step = c.step()
        assert not any(isinstance(e, ApplyClaim) for e in step.effects)  # the user's claim
    cond = c.cache()
    assert (cond["status"], cond["reason"]) == ("False", "ClaimNotFound")
    for words in ("PersistentVolumeClaim weights", "namespace ns", "create it", "spec.modelCache.size"):
        assert words in cond["message"], cond["message"]
    assert c.event_reasons().count("ModelCacheClaimNotFound") == 1  # one Event, not one per pass
    # the Deployment is still rendered (its pods wait for the claim), the phase is not Degraded
    assert c.deployment is not None and c.service is not None
    assert c.status["phase"] not in ("Degraded", "Failed")
    volumes = c.deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights"}} in volumes


def test_the_named_claim_appearing_pending_then_bound_moves_the_condition_with_one_event_each() -> None:
    c = cluster(claimName="weights")
    c.step()
    c.claim = user_claim("weights")
    c.step()
    c.step()
    cond = c.cache()
    assert (cond["status"], cond["reason"]) == ("False", "ClaimPending")
    assert "storage class fast" in cond["message"] and "no provisioner" in cond["message"]
    assert "stay Pending until it binds" in cond["message"]
    c.claim = bound(c.claim)
    c.step()
    c.step()
    cond = c.cache()
    assert (cond["status"], cond["reason"]) == ("True", "Bound")
    assert "bound to volume pv-1 (200Gi)" in cond["message"]
    assert c.event_reasons() == [
        "BudgetPlanned",
        "ModelCacheClaimNotFound",
        "ModelCacheClaimPending",
        "ModelCacheBound",
    ]


def test_a_lost_claim_says_the_volume_is_gone_and_how_to_recover() -> None:
    c = cluster(claimName="weights")
    c.claim = {**bound(user_claim("weights")), "status": {"phase": "Lost"}}
    c.step()
    cond = c.cache()
    assert (cond["status"], cond["reason"]) == ("False", "ClaimLost")
    assert "lost its volume pv-1" in cond["message"] and "spec.modelCache.claimName" in cond["message"]
    assert [e.type for e in c.events.values() if e.reason == "ModelCacheClaimLost"] == ["Warning"]


def test_without_a_cache_the_condition_is_removed() -> None:
    c = cluster(claimName="weights")
    c.step()
    assert c.cache()
    del c.spec["modelCache"]
    c.generation += 1
    c.step()
    assert c.cache() == {}
    assert needs(c.spec, "svc", deployment=None, pods=[]).claim is None  # and the edge reads no claim


# --------------------------------------------------------------------------------------------
# A claim rankguard creates


def test_size_creates_an_owned_claim_before_the_deployment_is_applied() -> None:
    c = cluster(size="200Gi", storageClassName="fast", accessModes=["ReadWriteMany"])
    step = c.step()
    kinds = [type(e).__name__ for e in step.effects]
    assert kinds[:2] == ["ApplyClaim", "PostEvent"] and kinds.index("ApplyClaim") < kinds.index(
        "ApplyDeployment"
    )
    (claim,) = c.claims_applied
    assert (
        claim["metadata"]["name"]
        == cache_claim_name("svc")
        == needs(c.spec, "svc", deployment=None, pods=[]).claim
    )
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "200Gi"}},
        "storageClassName": "fast",
    }
    cond = c.cache()
    assert (cond["status"], cond["reason"]) == ("False", "ClaimPending")  # "creating" this pass


def test_the_created_claim_is_applied_again_only_after_a_spec_change_or_when_it_went_missing() -> None:
    c = cluster(size="200Gi")
    c.step()
    for _ in range(3):
        c.step()
    assert len(c.claims_applied) == 1  # steady: not applied every pass
    c.spec["modelCache"]["size"] = "300Gi"
    c.generation += 1
    c.step()
    assert len(c.claims_applied) == 2
    assert c.claims_applied[-1]["spec"]["resources"]["requests"]["storage"] == "300Gi"
    c.claim = None  # deleted by someone
    c.step()
    assert len(c.claims_applied) == 3


def test_a_claim_of_that_name_rankguard_did_not_create_is_used_never_adopted() -> None:
    spec = parse_spec({**cluster(size="200Gi").spec})
    theirs = user_claim(cache_claim_name("svc"))
    assert claim_to_apply(spec, "svc", "ns", "uid-1", theirs, spec_changed=True) is None
    ours = {**theirs, "metadata": {**theirs["metadata"], "ownerReferences": [{"uid": "uid-1"}]}}
    assert claim_to_apply(spec, "svc", "ns", "uid-1", ours, spec_changed=True) is not None
    assert claim_to_apply(spec, "svc", "ns", "uid-1", ours, spec_changed=False) is None


def test_no_claim_without_a_cache_and_no_condition() -> None:
    c = CacheCluster()
    step = c.step()
    assert not any(isinstance(e, ApplyClaim) for e in step.effects)
    assert c.cache() == {}
