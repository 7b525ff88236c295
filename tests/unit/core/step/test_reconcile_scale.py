"""`reconcile.step` under the scale subresource: `kubectl scale`, an HPA or KEDA move
spec.replicas (the generation goes up with it) and the operator follows without fighting them.
The workload's replicas change and nothing else does: no pod rolls, no budget is planned again,
the headroom clocks, the remediation history, last-known-good and the conditions stay as they
were. status.replicas and status.selector, which the scale subresource reads, are written every
pass, a refused one too, and the selector picks exactly the pods the render labels.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from rankguard_operator.core.effects import ApplyDeployment, ApplyObject, DeleteObject, PostEvent, WriteIntent
from rankguard_operator.core.names import LWS_KIND, ROLE_LABEL
from rankguard_operator.core.observe.pods import deployment_template_hash
from rankguard_operator.core.units import GiB
from tests.unit.core.step.group_world import GroupCluster, role_of
from tests.unit.core.step.test_keep_shapes import ShapeCluster, on_lws
from tests.unit.reconcile_world import Cluster, crash_loop, engine_error_record, pod, report, running

# --------------------------------------------------------------------------------------------
# The label selector string, read by Kubernetes' rules (apimachinery pkg/labels: a comma-separated
# list of requirements; an equality requirement `key=value` or `key==value`; a key an optional
# DNS-subdomain prefix and `/`, then a name of at most 63 characters; a value at most 63).

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_VALUE = rf"({_NAME})?"


def parse_selector(text: str) -> dict[str, str]:
    """The equality requirements of a selector string, as Kubernetes parses them; any other
    form (set-based, inequality, a bad key or value) fails the test: rankguard writes none."""
    out: dict[str, str] = {}
    for term in text.split(","):
        key, sep, value = term.partition("==") if "==" in term else term.partition("=")
        assert sep and "!" not in key, f"not an equality requirement: {term!r}"
        prefix, slash, name = key.rpartition("/")
        assert re.fullmatch(_NAME, name), f"bad key name {name!r}"
        assert not slash or (len(prefix) <= 253 and re.fullmatch(_PREFIX, prefix)), f"bad prefix {prefix!r}"
        assert len(value) <= 63 and re.fullmatch(_VALUE, value), f"bad value {value!r}"
        assert key not in out, f"{key} required twice"
        out[key] = value
    return out


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_selector_parser_can_fail() -> None:
    for bad in ("a in (b)", "a!=b", "a", "-a=b", "a=b,a=c", "a=" + "b" * 64):
        try:
            parse_selector(bad)
        except AssertionError:
            continue
        raise AssertionError(f"{bad!r} parsed")
    assert parse_selector("rankguard.io/llmservice=svc,app.kubernetes.io/name==vllm") == {
        "rankguard.io/llmservice": "svc",
        "app.kubernetes.io/name": "vllm",
    }


# --------------------------------------------------------------------------------------------
# status.replicas and status.selector


def test_status_says_the_replicas_that_exist_and_selects_exactly_the_rendered_pods() -> None:
    c = Cluster()
    c.run()
    assert c.status["replicas"] == 0  # applied, no pod created yet
    c.controller_done()
    c.run()
    assert c.status["replicas"] == 1
    assert c.deployment is not None and c.service is not None
    pick = parse_selector(c.status["selector"])
    assert pick == c.deployment["spec"]["selector"]["matchLabels"] == c.service["spec"]["selector"]
    assert selects(pick, c.deployment["spec"]["template"]["metadata"]["labels"])
    # another service's pods are not this one's
    other = {**c.deployment["spec"]["template"]["metadata"]["labels"], "rankguard.io/llmservice": "svc2"}
    assert not selects(pick, other)


def test_a_refused_spec_still_writes_the_replicas_and_the_selector() -> None:
    c = running()
    selector = c.status["selector"]
    c.spec["tensorParallelSize"] = 3  # 32 attention heads do not split 3 ways
    c.generation += 1
    c.run()
    assert c.status["phase"] == "Failed"
    assert c.status["replicas"] == 1 and c.status["selector"] == selector
    del c.status["replicas"], c.status["selector"]  # as an operator of before the scale subresource left it
    c.run()
    assert c.status["replicas"] == 1 and c.status["selector"] == selector


def test_a_group_service_counts_groups_and_selects_their_leaders() -> None:
    c = GroupCluster()
    c.settle()
    assert c.status["replicas"] == 2
    pick = parse_selector(c.status["selector"])
    assert pick[ROLE_LABEL] == "leader"
    chosen = sorted(p["metadata"]["name"] for p in c.pods.values() if selects(pick, p["metadata"]["labels"]))
    leaders = sorted(p["metadata"]["name"] for p in c.pods.values() if role_of(p) == "leader")
    assert chosen == leaders == ["svc-g0-0", "svc-g1-0"]
    assert c.service is not None and c.service["spec"]["selector"] == pick


# --------------------------------------------------------------------------------------------
# A scaler moves spec.replicas


def test_a_scaled_service_scales_its_deployment_and_rolls_nothing() -> None:
    c = running()
    name = str(c.pods[0]["metadata"]["name"])
    low = report((GiB // 16, GiB // 16), c.clock)  # below the 128Mi minimum: the low clock runs
    c.run(reports=((name, low, c.clock),))
    assert c.deployment is not None
    before = {
        "hash": deployment_template_hash(c.deployment),
        "template": c.deployment["spec"]["template"],
        "status": {
            k: c.status.get(k)
            for k in (
                "lowHeadroomSince",
                "ampleHeadroomSince",
                "remediations",
                "lastKnownGood",
                "servingFlags",
                "budget",
                "budgetKey",
            )
        },
        "conditions": {x["type"]: (x["status"], x["reason"]) for x in c.status["conditions"]},
    }
    assert before["status"]["lowHeadroomSince"] is not None
    c.spec["replicas"] = 3
    c.generation += 1
    step = c.run(reports=((name, low, c.clock),))
    assert c.deployment["spec"]["replicas"] == 3
    assert deployment_template_hash(c.deployment) == before["hash"]
    assert c.deployment["spec"]["template"] == before["template"]
    assert not any(isinstance(e, WriteIntent) for e in step.effects)
    assert [e.reason for e in step.effects if isinstance(e, PostEvent)] == []
    # the Deployment's count, and nothing an edit of the spec re-applies (Service, old shapes)
    assert [type(e).__name__ for e in step.effects] == ["ApplyDeployment", "WriteStatus"]
    assert step.decision is None or not step.decision.changes_flags
    assert {k: c.status.get(k) for k in before["status"]} == before["status"]
    # scaling is progress (as a Deployment's own condition says), but no roll: not RollingOut,
    # and Ready waits for every replica asked for (docs/operations.md)
    progressing = next(x for x in c.status["conditions"] if x["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "Scaling")
    assert c.status["ready"] == "1/3" and c.status["replicas"] == 1
    # the ReplicaSet adds two pods of the same template beside the one that keeps serving
    annotations = c.deployment["spec"]["template"]["metadata"]["annotations"]
    c.pods += [pod(f"svc-new-{i}", annotations, ready=True) for i in (1, 2)]
    c.deployment["status"] = {
        "observedGeneration": c.deployment["metadata"]["generation"],
        **{f"{k}eplicas": 3 for k in ("r", "updatedR", "readyR", "availableR")},
    }
    c.run(reports=((name, low, c.clock),))
    assert c.status["replicas"] == 3 and c.status["ready"] == "3/3" and c.status["readyReplicas"] == 3
    after = {x["type"]: (x["status"], x["reason"]) for x in c.status["conditions"]}
    # MemoryCreep's series is of the pods that run the template (core/observe/memory_trend):
    # new pods start it over, as any new process does
    assert after.pop("MemoryCreep")[0] == before["conditions"].pop("MemoryCreep")[0] == "False"
    assert after == before["conditions"]
    assert c.status["lowHeadroomSince"] == before["status"]["lowHeadroomSince"]


def test_a_sticky_degraded_survives_a_scale_but_not_an_edit() -> None:
    """OOMAtFloor says rankguard has done all it may: a scaler adding replicas fixes nothing, a
    person's edit of the spec may."""
    c = running()
    degraded = {
        "type": "Degraded",
        "status": "True",
        "reason": "OOMAtFloor",
        "message": "the KV budget is at its floor and vLLM still runs out of memory",
        "lastTransitionTime": "2027-01-15T08:00:00Z",
        "observedGeneration": c.generation,
    }
    c.status["conditions"] = [x for x in c.status["conditions"] if x["type"] != "Degraded"] + [degraded]
    c.spec["replicas"] = 2
    c.generation += 1
    c.run()
    kept = next(x for x in c.status["conditions"] if x["type"] == "Degraded")
    assert (kept["status"], kept["reason"]) == ("True", "OOMAtFloor")
    assert c.status["phase"] == "Degraded"
    c.spec["engine"] = {**c.spec["engine"], "maxModelLen": 4096}
    c.generation += 1
    c.run()
    cleared = next(x for x in c.status["conditions"] if x["type"] == "Degraded")
    assert cleared["status"] == "False"


def test_a_group_service_scales_by_whole_groups() -> None:
    c = GroupCluster()
    c.spec["replicas"] = 1
    c.run()
    progressing = next(x for x in c.status["conditions"] if x["type"] == "Progressing")
    assert progressing["reason"] != "Scaling"  # the first start is no scale
    c.tick()
    c.settle()
    assert c.status["replicas"] == 1
    hashes = {p["metadata"]["annotations"]["rankguard.io/template-hash"] for p in c.pods.values()}
    first = {n: p["metadata"]["uid"] for n, p in c.pods.items()}
    c.spec["replicas"] = 2
    c.generation += 1
    step = c.run()
    applied = sorted(e.body["metadata"]["name"] for e in step.effects if isinstance(e, ApplyObject))
    assert "svc-g1" in applied and "svc-g1-w" in applied
    assert not any(isinstance(e, DeleteObject | ApplyDeployment | WriteIntent) for e in step.effects)
    progressing = next(x for x in c.status["conditions"] if x["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "Scaling")
    c.tick()
    c.settle()
    assert sorted(c.pods) == ["svc-g0-0", "svc-g0-w-1", "svc-g1-0", "svc-g1-w-1"]
    # group 0 is the same pods; group 1 runs the same template
    assert {n: c.pods[n]["metadata"]["uid"] for n in first} == first
    assert {p["metadata"]["annotations"]["rankguard.io/template-hash"] for p in c.pods.values()} == hashes
    assert c.status["replicas"] == 2 and c.status["ready"] == "2/2"


def test_a_scale_in_the_middle_of_a_roll_leaves_it_a_roll_and_an_edit_with_it_rolls() -> None:
    c = running()
    c.spec["image"] = "vllm/vllm-openai:v0.12.0"
    c.spec["replicas"] = 2
    c.generation += 1
    c.run()
    progressing = next(x for x in c.status["conditions"] if x["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RollingOut")
    assert c.template_changed()
    c.spec["replicas"] = 3
    c.generation += 1
    c.run()
    progressing = next(x for x in c.status["conditions"] if x["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RollingOut")
    assert c.deployment is not None and c.deployment["spec"]["replicas"] == 3


def test_a_failed_service_at_zero_stays_there_when_scaled_and_comes_back_at_the_scalers_count() -> None:
    """core/step/scale_down: a Failed service holds no GPUs. A scaler's count is kept in the spec
    and not applied (the pods would crash as the others did) until the spec is fixed."""
    c = running()
    crash_loop(c, engine_error_record(), run=0)
    c.spec["engine"] = {**c.spec["engine"], "extraArgs": ["--enable-frobnication"]}
    c.generation += 1
    c.run()
    assert c.deployment is not None and c.deployment["spec"]["replicas"] == 0
    c.deployment["status"] = {**c.deployment["status"], "replicas": 0}
    c.pods = []
    c.run()
    assert c.status["phase"] == "Failed" and c.status["replicas"] == 0
    c.spec["replicas"] = 3
    c.generation += 1
    step = c.run()
    assert not any(isinstance(e, ApplyDeployment) for e in step.effects)
    assert c.deployment["spec"]["replicas"] == 0 and c.status["replicas"] == 0
    assert c.status["selector"]  # an HPA still reads the scale subresource
    c.spec["engine"] = {k: v for k, v in c.spec["engine"].items() if k != "extraArgs"}
    c.generation += 1
    c.run()
    assert c.deployment["spec"]["replicas"] == 3


def test_a_leader_worker_set_takes_the_scalers_count_and_nothing_else() -> None:
    c = ShapeCluster(spec=on_lws())
    c.settle(passes=3)
    before = next(iter(c.of_kind(LWS_KIND)))
    c.spec["replicas"] = 3
    c.generation += 1
    step = c.run()
    [applied] = [e.body for e in step.effects if isinstance(e, ApplyObject)]
    assert applied["kind"] == LWS_KIND and applied["spec"]["replicas"] == 3
    assert applied["spec"]["leaderWorkerTemplate"] == before["spec"]["leaderWorkerTemplate"]
    assert not [e for e in c.run().effects if isinstance(e, ApplyObject)]  # once, not every pass
    # a count changed on the LeaderWorkerSet by hand is put back, as a Deployment's is
    c.objects[(LWS_KIND, "svc")]["spec"]["replicas"] = 5
    [again] = [e.body for e in c.run().effects if isinstance(e, ApplyObject)]
    assert again["spec"]["replicas"] == 3
