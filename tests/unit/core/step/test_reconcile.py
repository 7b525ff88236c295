"""`reconcile.step`: every path of one operator pass, without a cluster.

A small in-memory cluster (`Cluster`) carries out the effects the way the edge executor does
(status merge patches, Deployment applies with generations, named Events), so the tests read
like the loop: apply an LLMService, let a pod run, let it die, and count what was rolled.
The property at the end drives crashes of the operator between any two effects.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.effects import ApplyDeployment, PostEvent, WriteIntent
from rankguard_operator.core.names import (
    FLAGS_ANNOTATION,
    REMEDIATION_ID_ANNOTATION,
    TEMPLATE_HASH_ANNOTATION,
    label_value,
)
from rankguard_operator.core.observe.pods import deployment_template_hash
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import World, after_apply, needs, reconcile
from rankguard_operator.core.units import GiB
from tests.unit.reconcile_world import (
    SETTINGS,
    SPEC,
    T0,
    Cluster,
    crash_the_pod,
    flags_of,
    pod,
    report,
    running,
)

# --------------------------------------------------------------------------------------------
# First pass, steady state, invalid spec


def test_the_first_pass_renders_the_planned_budget_and_writes_status() -> None:
    c = Cluster()
    step = c.run()
    kinds = [type(e).__name__ for e in step.effects]
    assert kinds == ["PostEvent", "ApplyDeployment", "ApplyService", "WriteStatus"]
    plan = prior_plan(parse_spec(SPEC))
    assert plan is not None
    assert (
        c.deployment is not None
        and flags_of(c.deployment).kv_cache_memory_bytes == plan.kv_cache_memory_bytes
    )
    assert c.status["servingFlags"] == {"kvCacheMemoryBytes": plan.kv_cache_memory_bytes}
    assert c.status["phase"] == "Deploying"  # applied, not yet observed by the controller
    assert [e.reason for e in c.events.values()] == ["BudgetPlanned"]
    assert step.state.serving_flags == flags_of(c.deployment)


def test_a_steady_pass_changes_nothing_and_writes_nothing() -> None:
    c = running()
    assert c.status["phase"] == "Running"
    # The status write of a pass carries its clock-derived fields; two passes in the same
    # second over the same world write nothing and apply nothing.
    c.clock -= 2.0
    again = reconcile.step(c.state(), c.world(), SETTINGS)
    assert [e for e in again.effects if not isinstance(e, PostEvent)] == []


def test_an_invalid_spec_gets_a_condition_and_an_event_and_nothing_is_applied() -> None:
    c = Cluster()
    c.spec["tensorParallelSize"] = 3  # 32 attention heads do not split 3 ways
    step = c.run()
    assert [type(e).__name__ for e in step.effects] == ["PostEvent", "WriteStatus"]
    assert c.deployment is None and c.service is None
    assert c.status["phase"] == "Failed"
    degraded = next(x for x in c.status["conditions"] if x["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "tensorParallelSize" in degraded["message"]


def test_a_spec_edit_reapplies_the_service_and_rolls_the_template() -> None:
    c = running()
    applies = len(c.deployments_applied)
    c.spec["image"] = "vllm/vllm-openai:v0.12.0"
    c.generation += 1
    step = c.run()
    kinds = [type(e).__name__ for e in step.effects]
    assert "ApplyDeployment" in kinds and "ApplyService" in kinds
    assert len(c.deployments_applied) == applies + 1
    assert c.deployment is not None
    assert c.deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.12.0"


def test_replicas_changed_by_hand_are_put_back() -> None:
    c = running()
    assert c.deployment is not None
    c.deployment["spec"]["replicas"] = 5
    step = c.run()
    assert any(isinstance(e, ApplyDeployment) for e in step.effects)
    assert c.deployment["spec"]["replicas"] == 1


def test_only_reports_of_pods_on_the_template_in_effect_are_read() -> None:
    c = running()
    live = c.pods[0]
    old = pod("svc-old", {TEMPLATE_HASH_ANNOTATION: "0000", FLAGS_ANNOTATION: "{}"}, ready=True)
    c.pods = [live, old]
    low = report((GiB // 8, GiB // 8), c.clock)  # far below the minimum headroom
    ok = report((6 * GiB, 6 * GiB), c.clock)
    c.run(
        reports=((str(old["metadata"]["name"]), low, c.clock), (str(live["metadata"]["name"]), ok, c.clock))
    )
    assert [r["minFreeBytes"] for r in c.status["ranks"]] == [6 * GiB, 6 * GiB]
    assert c.status["ranks"][0]["pod"] == live["metadata"]["name"]


def test_scrape_targets_are_the_ready_pods_of_the_live_template() -> None:
    c = running()
    live = c.pods[0]
    stale = pod("svc-old", {TEMPLATE_HASH_ANNOTATION: "0000"}, ready=True)
    not_ready = pod("svc-nr", live["metadata"]["annotations"], ready=False)
    targets = needs(c.spec, "svc", deployment=c.deployment, pods=[live, stale, not_ready]).targets
    assert list(targets) == [(live["metadata"]["name"], "127.0.0.9", 9404)]
    assert needs({"model": {}}, "svc", deployment=c.deployment, pods=[live]).targets == ()  # unreadable spec


# --------------------------------------------------------------------------------------------
# A remediation: intent, roll, Event, status, in that order


def test_a_cuda_oom_writes_the_intent_then_rolls_once_then_reports() -> None:
    c = running()
    before = c.deployment
    assert before is not None
    old_kv = flags_of(before).kv_cache_memory_bytes
    key = crash_the_pod(c)
    step = c.run()
    kinds = [type(e).__name__ for e in step.effects]
    assert kinds == ["WriteIntent", "ApplyDeployment", "PostEvent", "WriteStatus"]
    intent, roll, event = step.effects[0], step.effects[1], step.effects[2]
    assert isinstance(intent, WriteIntent) and isinstance(roll, ApplyDeployment)
    assert isinstance(event, PostEvent)
    rid = intent.pending["id"]
    assert roll.body["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == rid == roll.remediation_id
    assert event.name == rid and event.reason == "ShrinkKVCache" and event.type == "Warning"
    new_kv = flags_of(roll.body).kv_cache_memory_bytes
    assert old_kv is not None and new_kv is not None and new_kv < old_kv
    assert "pendingRemediation" not in c.status
    assert key in c.status["handledTerminations"]
    [entry] = c.status["remediations"]
    assert entry["revision"] == rid and entry["trigger"] == "CUDAOutOfMemory"
    assert c.status["phase"] == "Remediating"
    # The same termination seen again (the old pod lingers while it terminates): nothing more.
    again = c.run()
    assert not any(isinstance(e, (ApplyDeployment, WriteIntent)) for e in again.effects)


def test_a_pending_remediation_not_yet_rolled_is_rolled_with_its_own_id() -> None:
    c = running()
    crash_the_pod(c)
    c.run(crash_after=1)  # the intent is written, then the operator dies
    pending = c.status["pendingRemediation"]
    step = c.run()  # a restarted operator
    rolls = [e for e in step.effects if isinstance(e, ApplyDeployment)]
    assert len(rolls) == 1
    assert rolls[0].body["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == pending["id"]
    assert [h["revision"] for h in c.status["remediations"]] == [pending["id"]]
    assert [e.reason for e in step.effects if isinstance(e, PostEvent)] == ["RemediationResumed"]
    assert "pendingRemediation" not in c.status


def test_a_pending_remediation_already_rolled_is_only_recorded() -> None:
    c = running()
    crash_the_pod(c)
    c.run(crash_after=2)  # intent and roll done; the operator died before the Event and status
    assert c.deployment is not None
    rid = c.deployment["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION]
    step = c.run()
    assert not any(isinstance(e, ApplyDeployment) for e in step.effects)
    assert [h["revision"] for h in c.status["remediations"]] == [rid]
    events = [e for e in step.effects if isinstance(e, PostEvent)]
    assert [(e.reason, e.name) for e in events] == [("RemediationResumed", rid)]


def test_a_hold_is_reported_as_a_repeating_event_without_a_roll() -> None:
    c = running()
    c.spec["remediation"] = {"enabled": False}
    c.generation += 1
    crash_the_pod(c)
    step = c.run()
    assert not any(isinstance(e, (WriteIntent, ApplyDeployment)) for e in step.effects)
    [event] = [e for e in step.effects if isinstance(e, PostEvent)]
    assert event.reason == "RemediationDisabled" and event.repeat and event.name is None
    assert c.status["phase"] == "Degraded"


# --------------------------------------------------------------------------------------------
# Restart safety as a property: crash anywhere, any number of times, one roll per termination


@settings(max_examples=80, deadline=None)
@given(
    crashes=st.lists(st.tuples(st.integers(min_value=0, max_value=4), st.booleans()), min_size=0, max_size=4)
)
def test_any_crash_interleaving_rolls_exactly_once_per_termination(crashes: list[tuple[int, bool]]) -> None:
    c = running()
    start_rolls = c.kv_rolls()
    key = crash_the_pod(c)
    for crash_after, controller_moves in crashes:
        c.run(crash_after=crash_after)  # the operator dies after `crash_after` effects ...
        if controller_moves and c.template_changed():
            # ... and while it is down the Deployment controller replaces the crashed pod with
            # one of the template it holds now: the termination is gone when the operator
            # comes back, so only what was written down can tell it what it did. (A pod whose
            # template did not change is not replaced: its container restarts in place.)
            c.controller_done()
    for _ in range(3):  # then it runs undisturbed
        c.run()
    rolls = c.kv_rolls()
    assert len(rolls) == len(start_rolls) + 1, rolls
    assert key in c.status["handledTerminations"]
    assert "pendingRemediation" not in c.status
    assert len(c.status["remediations"]) == 1
    rid = c.status["remediations"][0]["revision"]
    assert c.deployment is not None
    assert c.deployment["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == rid
    # One Event for the remediation, whichever pass posted it.
    assert [k for k in c.events if k == rid] == [rid]


# --------------------------------------------------------------------------------------------
# Small pure pieces


def test_after_apply_bumps_the_generation_only_when_the_spec_changes() -> None:
    c = running()
    live = c.deployment
    assert live is not None
    same = after_apply(live, copy.deepcopy(live))
    assert same["metadata"]["generation"] == live["metadata"]["generation"]
    changed = copy.deepcopy(live)
    changed["spec"]["replicas"] = 2
    assert after_apply(live, changed)["metadata"]["generation"] == live["metadata"]["generation"] + 1
    first = after_apply(None, changed)
    assert first["metadata"]["generation"] == 1 and first["status"] == {}


def test_state_reads_a_hand_edited_status_without_crashing() -> None:
    s = ServiceState.from_status(
        {
            "servingFlags": {"kvCacheMemoryBytes": -1},
            "handledTerminations": "not a list",
            "remediations": [1, "x", {"time": "bad"}],
            "pendingRemediation": {"id": 7},
            "lowHeadroomSince": "yesterday",
            "observedGeneration": True,
        }
    )
    assert s.serving_flags is None and s.handled == () and s.pending is None
    assert s.low_headroom_since is None and s.observed_generation is None
    assert len(s.history) == 1  # kept as written; history_from_status skips what it cannot read


@pytest.mark.parametrize("name", ["a" * 63, "b" * 64, "c" * 253])
def test_pods_of_a_long_named_service_are_found_under_the_index_key(name: str) -> None:
    """Before: render truncated the pod label while the loop looked pods up by the full name,
    so a service named over 63 characters never saw its pods."""
    body = reconcile.step(
        ServiceState(),
        World(name=name, namespace="ns", uid="u", generation=1, spec=SPEC, now=T0, new_id="r"),
        SETTINGS,
    )
    [apply] = [e for e in body.effects if isinstance(e, ApplyDeployment)]
    pod_labels = apply.body["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["rankguard.io/llmservice"] == label_value(name)
    assert len(label_value(name)) <= 63
    assert deployment_template_hash(apply.body) is not None
