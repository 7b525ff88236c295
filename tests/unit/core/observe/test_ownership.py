"""Which pods an LLMService trusts: only those its own Deployment's ReplicaSets made.

Before the owner-chain rule, any pod carrying rankguard's labels was scraped and its
termination message acted upon: one forged pod cut a service's KV budget from 37.7 to
17.4 GiB. Before the provenance rule (issue 30), an ownerReference to the real ReplicaSet was
enough: an orphan pod that wrote the agent's CUDA-OOM record and was patched, once Failed, to
carry the service's labels and that ownerReference moved the budget 37.8 -> 10 GiB in four
rolls. A pod now counts only when it is what its owner makes: its name, and its restartPolicy
and vllm container exactly as in its owner's pod template. The step-level tests feed such
pods to the pure step through the same filter the executor applies.

(The owner-chain tests' pods are named and specced as their ReplicaSet makes them, so they
test the chain alone; the pods are told apart by `tag`. test_ownership_provenance.py tests the
name and template checks themselves, with these fixtures.)
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.effects import ApplyDeployment, WriteIntent
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe import ownership
from rankguard_operator.core.render.deployment import render_deployment
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.step import Step, reconcile
from rankguard_operator.core.units import GiB
from tests.builders import owned, owner_ref
from tests.unit.reconcile_world import SETTINGS, crash_the_pod, cuda_oom_record, running

SERVICE_UID = "uid-1"  # reconcile_world's LLMService
SPEC = parse_spec(
    {
        "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
        "image": "vllm/vllm-openai:v0.33.0",
        "memory": {"gpuMemoryBytes": 80 * GiB},
        "template": {
            "spec": {"containers": [{"name": "vllm", "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]}]}
        },
    }
)


def rendered_template(kv: int = 10 * GiB) -> dict[str, Any]:
    """The pod template rankguard renders (so the fields compared are the real ones)."""
    dep = render_deployment(
        "svc",
        "ns",
        SERVICE_UID,
        SPEC,
        ServingFlags(kv_cache_memory_bytes=kv),
        agent_image="a:1",
        plan=prior_plan(SPEC),
    )
    template: dict[str, Any] = dep["spec"]["template"]
    return template


TEMPLATE = rendered_template()["spec"]
OLD_TEMPLATE = rendered_template(12 * GiB)["spec"]
RS_NAMES = {"rs-1": "svc-6f7d9c4b8", "rs-old": "svc-5c8b7d6f4", "rs-other": "other-7b9c5d8f6"}
RS_OWNERS = {
    "rs-1": ownership.ReplicaSetRef("dep-1", RS_NAMES["rs-1"], ownership.template_fingerprint(TEMPLATE)),
    "rs-old": ownership.ReplicaSetRef(
        "dep-1", RS_NAMES["rs-old"], ownership.template_fingerprint(OLD_TEMPLATE)
    ),
    "rs-other": ownership.ReplicaSetRef(
        "dep-2", RS_NAMES["rs-other"], ownership.template_fingerprint(TEMPLATE)
    ),
}


def deployment(uid: str = "dep-1", owner: str = SERVICE_UID, kind: str = "LLMService") -> dict[str, Any]:
    return owned("svc", uid, owner_ref(kind, owner))


def pod(
    tag: str,
    rs: str | None,
    *,
    controller: bool = True,
    kind: str = "ReplicaSet",
    name: str | None = None,
    spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A pod as ReplicaSet `rs` makes it (its name and its template), unless told otherwise."""
    refs = [] if rs is None else [owner_ref(kind, rs, controller=controller)]
    base = RS_NAMES.get(rs or "", "svc-6f7d9c4b8")
    template = OLD_TEMPLATE if rs == "rs-old" else TEMPLATE
    return owned(
        name or f"{base}-x7k2q", f"uid-{tag}", *refs, spec=copy.deepcopy(template) if spec is None else spec
    )


def tags(pods: Any) -> list[str]:
    return [p["metadata"]["uid"].removeprefix("uid-") for p in pods]


def reasons(ignored: list[ownership.Ignored]) -> list[tuple[str, str]]:
    return [(i.uid.removeprefix("uid-"), i.reason) for i in ignored]


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
    assert tags(trusted) == ["real", "previous-rollout"]
    assert reasons(ignored) == [
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


# -------------------------------------------------------------------- provenance: the template
def _vllm(spec: dict[str, Any]) -> dict[str, Any]:
    (c,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    return dict(c)


def _changed(edit: str) -> dict[str, Any]:
    spec = copy.deepcopy(TEMPLATE)
    vllm = _vllm(spec)
    index = spec["containers"].index(next(c for c in spec["containers"] if c["name"] == "vllm"))
    if edit == "restartPolicy Never":  # so the forged container's exit leaves the pod Failed
        spec["restartPolicy"] = "Never"
    elif edit == "another image":
        vllm["image"] = "python:3.12"
    elif edit == "another command":  # a script that writes the agent's termination record
        vllm["command"] = ["python3", "-c", "open('/dev/termination-log','w').write('...')"]
    elif edit == "no agent wrapper":  # vllm serve alone, without the agent's launcher
        vllm["command"] = [
            a for a in vllm["command"] if "rankguard-agent" not in a and a not in ("launch", "--")
        ]
    elif edit == "another argument":
        vllm["args"] = [*(vllm.get("args") or []), "--enforce-eager"]
    elif edit == "one more env":
        vllm["env"] = [
            *vllm["env"],
            {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:False"},
        ]
    elif edit == "an env value":
        vllm["env"] = [{**e, "value": "0"} if e.get("value") == "1" else e for e in vllm["env"]]
    elif edit == "env reordered":  # $(VAR) expansion follows the order
        vllm["env"] = list(reversed(vllm["env"]))
    elif edit == "vllm container renamed":
        vllm["name"] = "engine"
    else:
        raise AssertionError(edit)
    spec["containers"][index] = vllm
    return spec


# ------------------------------------------------------------------------------ the step
def _owned(c: Any) -> None:
    assert c.deployment is not None
    c.deployment["metadata"]["uid"] = "dep-1"
    c.deployment["metadata"]["ownerReferences"] = [owner_ref("LLMService", SERVICE_UID)]


def _made_by_rs(c: Any, p: dict[str, Any]) -> tuple[dict[str, Any], dict[str, ownership.ReplicaSetRef]]:
    """`p` as the ReplicaSet of the world's Deployment makes it, and that ReplicaSet."""
    template = c.deployment["spec"]["template"]["spec"]
    p["metadata"].update(
        name="svc-6f7d9c4b8-x7k2q",
        ownerReferences=[owner_ref("ReplicaSet", "rs-1")],
    )
    p["spec"] = copy.deepcopy(template)
    ref = ownership.ReplicaSetRef("dep-1", "svc-6f7d9c4b8", ownership.template_fingerprint(template))
    return p, {"rs-1": ref}


def test_a_forged_pods_cuda_oom_does_not_change_the_budget() -> None:
    """The step sees only what the filter passes: a forged pod's OOM termination is not acted
    upon, while the same termination on the service's own pod is (so the test can fail)."""
    c = running()
    kv_before = c.status["servingFlags"]
    _owned(c)
    crash_the_pod(c)
    forged = copy.deepcopy(c.pods[0])
    forged["metadata"].update(name="forged", uid="uid-forged", ownerReferences=[])
    real, owners = _made_by_rs(c, c.pods[0])

    def step_with(pods: list[dict[str, Any]]) -> Step:
        trusted, _ = ownership.trusted_pods(pods, owners, c.deployment, SERVICE_UID)
        return reconcile.step(c.state(), replace(c.world(), pods=trusted), SETTINGS)

    forged_only = step_with([forged])
    assert not any(isinstance(e, ApplyDeployment) for e in forged_only.effects)
    assert forged_only.state.raw.get("servingFlags") == kv_before
    acted = step_with([real])
    assert any(isinstance(e, WriteIntent) for e in acted.effects)


@pytest.mark.parametrize("variant", ["late patch", "wrong name"])
def test_a_forged_pod_owned_by_the_real_replicaset_does_not_change_the_budget(variant: str) -> None:
    """The red team's attack: the real ReplicaSet as controller, the service's labels, the
    agent's CUDA-OOM record; its spec (late patch: a script, restartPolicy Never) or its name
    (wrong name: the template copied) gives it away. The same record on the real pod is acted
    upon, so the test can fail."""
    c = running()
    kv_before = c.status["servingFlags"]
    _owned(c)
    crash_the_pod(c)
    real, owners = _made_by_rs(c, copy.deepcopy(c.pods[0]))
    forged = copy.deepcopy(real)
    forged["metadata"]["uid"] = "uid-forged"
    if variant == "late patch":
        forged["spec"] = _changed("another command") | {"restartPolicy": "Never"}
        forged["status"]["phase"] = "Failed"
        forged["status"]["containerStatuses"][0]["state"] = {"terminated": cuda_oom_record()}
    else:
        forged["metadata"]["name"] = "forged-copy"

    def step_with(pods: list[dict[str, Any]]) -> Step:
        trusted, _ = ownership.trusted_pods(pods, owners, c.deployment, SERVICE_UID)
        return reconcile.step(c.state(), replace(c.world(), pods=trusted), SETTINGS)

    forged_only = step_with([forged])
    assert not any(isinstance(e, (ApplyDeployment, WriteIntent)) for e in forged_only.effects)
    assert forged_only.state.raw.get("servingFlags") == kv_before
    assert any(isinstance(e, WriteIntent) for e in step_with([real]).effects)
