"""Names two LLMServices would share, and cache claims another LLMService owns (issue 30).

A 70-character name and a second service named with its 63-character label value used to get
one label, one selector and one Service; a `claimName` could name another service's claim,
deleted with that service under this one's pods. The older holder keeps a name (whatever pass
runs first), the younger applies nothing and says why; another's claim is refused the same way,
and ModelCacheReady follows a claim that is being deleted or gone.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from rankguard_operator.core.conditions import condition
from rankguard_operator.core.effects import ApplyClaim, ApplyDeployment, ApplyObject, ApplyService
from rankguard_operator.core.names import group_service_name, label_value, owner_reference, service_name
from rankguard_operator.core.render.claim import claim_settled
from rankguard_operator.core.render.taken_names import (
    LABEL,
    Holder,
    NameRivals,
    Rival,
    held_names,
    taken,
)
from rankguard_operator.core.step import World
from rankguard_operator.edge.handlers import _rivals, llmservice_names
from rankguard_operator.edge.live_owner import OwnedElsewhere, other_owner
from tests.unit.reconcile_world import SPEC, Cluster

LONG = "llama3-70b-tp4-team-inference-platform-production-east-" + "x" * 15
SHORT = label_value(LONG)  # a literal name equal to LONG's shortened label value
EARLY, LATE = "2027-01-01T00:00:00Z", "2027-01-02T00:00:00Z"
MULTI = {**SPEC, "distributed": {"podsPerGroup": 2}, "tensorParallelSize": 2}


def test_the_long_name_and_its_label_value_take_the_same_label_and_service() -> None:
    assert len(LONG) == 70 and len(SHORT) == 63 and SHORT != LONG
    shared = held_names(LONG, {}) & held_names(SHORT, {})
    assert shared == {(LABEL, SHORT), ("Service", service_name(LONG))}


def test_a_multi_node_services_headless_service_is_a_name_it_takes() -> None:
    assert ("Service", "x-nodes") in held_names("x", MULTI)
    assert ("Service", "x-nodes") not in held_names("x", {})  # single-pod: no headless Service
    assert held_names("x", MULTI) & held_names("x-nodes", {}) == {("Service", group_service_name("x"))}


def test_a_statefulset_workload_takes_each_groups_sets_and_lws_its_own() -> None:
    sts = held_names("y", {**MULTI, "replicas": 2})
    assert {("StatefulSet", n) for n in ("y-g0", "y-g0-w", "y-g1", "y-g1-w")} <= sts
    lws = held_names("y-g0", {**MULTI, "distributed": {"podsPerGroup": 2, "workload": "LeaderWorkerSet"}})
    # LWS names its leaders' StatefulSet after itself: the first group's leaders of `y`
    assert ("StatefulSet", "y-g0") in lws & sts


def test_an_unreadable_spec_still_takes_its_label_and_service() -> None:
    assert held_names("z", {"replicas": "many"}) == {(LABEL, "z"), ("Service", "z")}


def rival(name: str, created: str, kind: str = LABEL) -> Rival:
    return Rival(kind, SHORT, Holder(name, f"uid-{name}", created))


@pytest.mark.parametrize(
    ("mine", "theirs", "refused"),
    [
        (LATE, EARLY, True),  # the other is older
        (EARLY, LATE, False),  # this one is older: the other is refused instead
        (EARLY, EARLY, True),  # same second: the name decides ("a…" < "l…")
    ],
)
def test_the_older_holder_keeps_the_name_whichever_pass_runs_first(
    mine: str, theirs: str, refused: bool
) -> None:
    me, other = LONG, "a-" + SHORT[2:]
    got = taken(me, NameRivals(mine, (rival(other, theirs),)))
    assert (got is not None) is refused
    # the other's pass decides the opposite: exactly one of the two keeps the name
    assert (taken(other, NameRivals(theirs, (rival(me, mine),))) is not None) is not refused


def test_no_rivals_or_an_unknown_index_refuses_nothing() -> None:
    assert taken("svc", None) is None
    assert taken("svc", NameRivals(LATE)) is None
    assert taken("svc", NameRivals(LATE, (rival("svc", EARLY),))) is None  # itself, re-created


# --------------------------------------------------------------------------------------------
# Through the step


class Named(Cluster):
    rivals: NameRivals | None = None
    cache_claim: dict[str, Any] | None = None

    def world(self, *a: Any, **kw: Any) -> World:
        return replace(
            super().world(*a, **kw), name_rivals=self.rivals, cache_claim=copy.deepcopy(self.cache_claim)
        )


APPLIES = (ApplyDeployment, ApplyService, ApplyObject, ApplyClaim)


def degraded(c: Cluster) -> dict[str, Any]:
    return dict(condition(c.status["conditions"], "Degraded") or {})


def test_a_younger_service_on_an_older_ones_name_applies_nothing_and_names_it() -> None:
    c = Named()
    c.rivals = NameRivals(LATE, (Rival(LABEL, "svc", Holder("svc-older", "uid-2", EARLY)),))
    for _ in range(3):
        step = c.run()
        assert not [e for e in step.effects if isinstance(e, APPLIES)]
    d = degraded(c)
    assert (d["status"], d["reason"]) == ("True", "NameTaken")
    for words in ("LLMService svc-older", "re-create it under another name", "'svc'"):
        assert words in d["message"], d["message"]
    assert (condition(c.status["conditions"], "Ready") or {}).get("reason") == "NameTaken"
    assert c.deployment is None and c.service is None

    # the older one is deleted: the index lists no rival, and the service proceeds
    c.rivals = NameRivals(LATE)
    step = c.run()
    assert any(isinstance(e, ApplyDeployment) for e in step.effects)
    assert any(isinstance(e, ApplyService) for e in step.effects)
    assert degraded(c).get("reason") != "NameTaken"


def test_the_older_service_is_not_held_back_by_a_younger_rival() -> None:
    c = Named()
    c.rivals = NameRivals(EARLY, (Rival(LABEL, "svc", Holder("svc-younger", "uid-2", LATE)),))
    step = c.run()
    assert any(isinstance(e, ApplyService) for e in step.effects)


# --------------------------------------------------------------------------------------------
# Cache claims


def others_claim(name: str = "weights", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "ownerReferences": [owner_reference("other-svc", "uid-other")],
            **meta,
        },
        "spec": {"volumeName": "pv-9"},
        "status": {"phase": "Bound"},
    }


def cache_cond(c: Cluster) -> dict[str, Any]:
    return dict(condition(c.status["conditions"], "ModelCacheReady") or {})


def test_a_claim_another_llmservice_owns_is_refused_naming_it() -> None:
    c = Named()
    c.spec["modelCache"] = {"claimName": "weights"}
    c.cache_claim = others_claim()
    step = c.run()
    assert not [e for e in step.effects if isinstance(e, APPLIES)]
    d, m = degraded(c), cache_cond(c)
    assert (d["status"], d["reason"]) == ("True", "ModelCacheClaimTaken")
    assert (m["status"], m["reason"]) == ("False", "ClaimOwnedByAnotherService")
    for words in ("PersistentVolumeClaim weights", "LLMService other-svc", "spec.modelCache.claimName"):
        assert words in d["message"], d["message"]

    # the owner went and took its claim along: the claim is gone, and said so
    c.cache_claim = None
    c.run()
    assert (cache_cond(c)["status"], cache_cond(c)["reason"]) == ("False", "ClaimNotFound")
    assert degraded(c).get("reason") != "ModelCacheClaimTaken"
    assert c.deployment is not None  # the pods wait for the claim; the roll is not held


def test_a_users_claim_shared_by_services_and_one_of_our_own_are_used() -> None:
    c = Named()
    c.spec["modelCache"] = {"claimName": "weights"}
    c.cache_claim = {
        "metadata": {"name": "weights"},
        "spec": {"volumeName": "pv"},
        "status": {"phase": "Bound"},
    }
    c.run()
    assert cache_cond(c)["status"] == "True"
    ours = others_claim()
    ours["metadata"]["ownerReferences"] = [owner_reference("svc", "uid-1")]
    c.cache_claim = ours
    c.run()
    assert cache_cond(c)["status"] == "True" and c.deployment is not None


def test_model_cache_ready_follows_a_claim_being_deleted_and_back() -> None:
    c = Named()
    c.spec["modelCache"] = {"claimName": "weights"}
    bound = {"metadata": {"name": "weights"}, "spec": {"volumeName": "pv"}, "status": {"phase": "Bound"}}
    c.cache_claim = bound
    c.run()
    assert cache_cond(c)["status"] == "True"
    c.cache_claim = {**bound, "metadata": {"name": "weights", "deletionTimestamp": LATE}}
    step = c.run()
    m = cache_cond(c)
    assert (m["status"], m["reason"]) == ("False", "ClaimTerminating")
    assert "being deleted" in m["message"]
    assert "ModelCacheClaimTerminating" in [e.reason for e in step.effects if hasattr(e, "reason")]
    c.cache_claim = None
    c.run()
    assert cache_cond(c)["reason"] == "ClaimNotFound"
    c.cache_claim = bound
    c.run()
    assert cache_cond(c)["status"] == "True"


def test_only_a_bound_claim_of_no_other_service_is_kept_between_reads() -> None:
    bound = {"metadata": {"name": "w"}, "status": {"phase": "Bound"}}
    assert claim_settled(bound, "svc")
    assert not claim_settled(None, "svc")
    assert not claim_settled({**bound, "metadata": {"name": "w", "deletionTimestamp": LATE}}, "svc")
    assert not claim_settled(others_claim(), "svc")
    assert claim_settled(others_claim(), "other-svc")


# --------------------------------------------------------------------------------------------
# The edge's index


async def test_the_names_index_and_the_daemons_lookup_find_each_other() -> None:
    index: dict[Any, list[Holder]] = {}
    for name, uid, created in ((LONG, "u1", EARLY), (SHORT, "u2", LATE), ("unrelated", "u3", EARLY)):
        meta = {"uid": uid, "creationTimestamp": created}
        body = {"metadata": meta}
        indexed = await llmservice_names(name=name, namespace="ns", meta=meta, spec={}, body=body)
        for key, holder in indexed.items():
            index.setdefault(key, []).append(holder)
    rivals = _rivals(index, "ns", SHORT, {})
    assert {(r.kind, r.holder.name) for r in rivals} == {(LABEL, LONG), ("Service", LONG)}
    assert taken(SHORT, NameRivals(LATE, tuple(rivals))) is not None
    assert taken(LONG, NameRivals(EARLY, tuple(_rivals(index, "ns", LONG, {})))) is None
    assert _rivals(index, "other-ns", SHORT, {}) == []


# --------------------------------------------------------------------------------------------
# The edge's live-owner check before an apply


def _owned(name: str, kind: str = "LLMService") -> dict[str, Any]:
    return {"metadata": {"ownerReferences": [{**owner_reference(name, f"uid-{name}"), "kind": kind}]}}


def test_an_object_another_llmservice_controls_is_never_applied_over() -> None:
    rendered = _owned("svc")
    assert other_owner(rendered, _owned("svc-older")) == "svc-older"
    assert other_owner(rendered, None) is None  # not there: created
    assert other_owner(rendered, _owned("svc")) is None  # ours (or our deleted predecessor's)
    assert other_owner(rendered, _owned("web", kind="Deployment")) is None  # no LLMService's
    assert other_owner(rendered, {"metadata": {}}) is None  # nobody's: server-side apply adopts it as before
    message = f"{OwnedElsewhere('Service', 'x', 'svc-older')}"
    assert "controller is LLMService svc-older" in message
