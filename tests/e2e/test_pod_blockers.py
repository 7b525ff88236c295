"""End to end: a pod that cannot start says why (issue 30). The commonest first-day mistake, an
HF token from a Secret that does not exist, is Degraded with a reason naming the Secret within
60 s of the pod's first try and Ready once the Secret is created; every other cause the sandbox
can produce (the real API server's admission and controllers, the process kubelet) is one row
of a table, all services at once in one namespace; and a Failed service whose pods serve
nothing is scaled to zero. The pure classes are in tests/unit/core/observe/test_pod_blockers.py.

Not here: image pull errors (the process kubelet has one "image" and pulls nothing), and a
StatefulSet's FailedCreate (a multi-node service; the unit tests cover its Event).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from kubernetes import client

from rankguard_operator.core.units import parse_iso
from tests.builders import llmservice

from .conftest import GROUP, VERSION, apply_service, condition, get_llmservice, wait_for

pytestmark = pytest.mark.e2e

GPU_BYTES = round(23.58 * 2**30)  # the scenario's card, given: planned from the start, no replan roll
SCENARIO = "llama3-8b-tp2-24gb"


def service(name: str, template: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
        "image": "vllm/vllm-openai:v0.33.0",
        "tensorParallelSize": 2,
        "engine": {"maxModelLen": 8192},
        "memory": {"gpuMemoryBytes": GPU_BYTES},
        **spec,
    }
    if template is not None:
        body["template"] = {"spec": template}
    return llmservice(name, body)


def degraded_as(api: client.ApiClient, ns: str, name: str, reason: str) -> dict[str, Any] | None:
    svc = get_llmservice(api, ns, name)
    d = condition(svc, "Degraded")
    return svc if d and d["status"] == "True" and d["reason"] == reason else None


def events(api: client.ApiClient, ns: str, name: str, reason: str) -> list[Any]:
    return list(
        client.CoreV1Api(api)
        .list_namespaced_event(ns, field_selector=f"involvedObject.name={name},reason={reason}")
        .items
    )


def pods_of(api: client.ApiClient, ns: str, name: str) -> list[Any]:
    return list(
        client.CoreV1Api(api)
        .list_namespaced_pod(ns, label_selector=f"app.kubernetes.io/instance={name}")
        .items
    )


HF_TOKEN = {
    "containers": [
        {
            "name": "vllm",
            "env": [
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "HF_TOKEN"}}}
            ],
        }
    ]
}


@pytest.mark.timeout(420)
def test_a_missing_hf_token_secret_is_said_within_a_minute_and_heals(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    ns = e2e_namespace
    make_node(SCENARIO, time_scale=4)
    apply_service(api, ns, service("token", HF_TOKEN))
    svc = wait_for(
        "Degraded PodConfigError",
        functools.partial(degraded_as, api, ns, "token", "PodConfigError"),
        120,
        dump=lambda: get_llmservice(api, ns, "token").get("status"),
    )
    d = condition(svc, "Degraded")
    assert d is not None
    assert 'secret "hf-token" not found' in d["message"] and "CreateContainerConfigError" in d["message"]
    assert "container vllm" in d["message"] and "create the Secret" in d["message"]
    assert svc["status"]["phase"] == "Degraded" and parse_iso(svc["status"]["stuckSince"]) is not None
    [pod] = pods_of(api, ns, "token")
    first_try = pod.status.start_time.timestamp()
    said = parse_iso(d["lastTransitionTime"])
    assert said is not None and said - first_try <= 60, (said - first_try, d)
    assert len(events(api, ns, "token", "PodConfigError")) == 1

    client.CoreV1Api(api).create_namespaced_secret(
        ns, {"metadata": {"name": "hf-token"}, "stringData": {"HF_TOKEN": "hf_sandbox"}}
    )

    def ready() -> dict[str, Any] | None:
        s = get_llmservice(api, ns, "token")
        r, deg = condition(s, "Ready"), condition(s, "Degraded")
        ok = r is not None and r["status"] == "True" and deg is not None and deg["status"] == "False"
        return s if ok else None

    healed = wait_for(
        "Ready once the Secret exists", ready, 240, dump=lambda: get_llmservice(api, ns, "token")
    )
    assert "stuckSince" not in healed["status"]


# a sidecar process that runs until the kubelet stops it (it never answers a probe)
SLEEPER = ["python3", "-c", "import signal; signal.pause()"]
# (service, its spec.template's spec, the Degraded reason, what the message must quote)
CASES: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "vol",
        {
            "volumes": [{"name": "extra", "configMap": {"name": "missing-cm"}}],
            "containers": [{"name": "vllm", "volumeMounts": [{"name": "extra", "mountPath": "/etc/extra"}]}],
        },
        "VolumeMountFailed",
        'configmap "missing-cm" not found',
    ),
    (
        "init",
        {
            "initContainers": [
                {"name": "fetch", "image": "python:3.12", "command": ["python3", "-c", "exit(3)"]}
            ]
        },
        "InitContainerFailed",
        "init container fetch",
    ),
    (
        "prio",
        {"priorityClassName": "no-such-class"},
        "PodCreateFailed",
        "no PriorityClass with name no-such-class",
    ),
    (
        "acct",
        {"serviceAccountName": "no-such-account"},
        "PodCreateFailed",
        'serviceaccount "no-such-account"',
    ),
    ("rtc", {"runtimeClassName": "no-such-runtime"}, "PodCreateFailed", 'RuntimeClass "no-such-runtime"'),
    ("sched", {"schedulerName": "no-such-scheduler"}, "NoScheduler", '"no-such-scheduler"'),
    (
        "side",
        {
            "containers": [
                {
                    "name": "proxy",
                    "image": "python:3.12",
                    "command": SLEEPER,
                    "readinessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 2, "failureThreshold": 1},
                }
            ]
        },
        "SidecarNotReady",
        "container proxy",
    ),
]


@pytest.mark.timeout(300)
def test_every_cause_the_sandbox_can_produce_has_its_own_reason(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    ns = e2e_namespace
    # room for the three cases the kubelet admits (a volume, an init container, a sidecar)
    make_node(SCENARIO, time_scale=4, gpus=8)
    for name, template, _, _ in CASES:
        apply_service(api, ns, service(name, template))
    pending = {name: (reason, quote) for name, _, reason, quote in CASES}
    said: dict[str, str] = {}

    def all_said() -> bool:
        for name, (reason, _) in list(pending.items()):
            svc = degraded_as(api, ns, name, reason)
            if svc is not None:
                d = condition(svc, "Degraded")
                assert d is not None
                said[name] = d["message"]
                del pending[name]
        return not pending

    wait_for(
        "every service Degraded with its own reason",
        all_said,
        200,
        dump=lambda: {n: condition(get_llmservice(api, ns, n), "Degraded") for n in pending},
    )
    for name, _, reason, quote in CASES:
        assert quote in said[name], (name, said[name])
        assert len(events(api, ns, name, reason)) == 1, name


@pytest.mark.timeout(300)
def test_a_failed_service_that_serves_nothing_holds_no_gpus(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    """A floor the card cannot hold, found once the pod's node states the GPU's size: Failed, and
    the Deployment is scaled to zero; fixed, it is scaled back."""
    ns = e2e_namespace
    make_node(SCENARIO, time_scale=4)
    doc = service("floor", remediation={"minKVCacheBytes": 64 * 2**30})  # a 24 GB card
    del doc["spec"]["memory"]  # no size in the spec: the CRD cannot compare, the node's labels do
    apply_service(api, ns, doc)
    apps = client.AppsV1Api(api)

    def scaled_to_zero() -> dict[str, Any] | None:
        svc = degraded_as(api, ns, "floor", "InvalidSpec")
        if svc is None:
            return None
        [dep] = apps.list_namespaced_deployment(ns).items
        return svc if dep.spec.replicas == 0 else None

    svc = wait_for(
        "Failed and scaled to zero",
        scaled_to_zero,
        150,
        dump=lambda: get_llmservice(api, ns, "floor").get("status"),
    )
    d = condition(svc, "Degraded")
    assert (
        d is not None and "scaled it to zero replicas" in d["message"] and svc["status"]["phase"] == "Failed"
    )
    wait_for("its pod gone", lambda: not pods_of(api, ns, "floor"), 60)

    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, ns, "llmservices", "floor", {"spec": {"remediation": {"minKVCacheBytes": None}}}
    )

    def scaled_back() -> bool:
        [dep] = apps.list_namespaced_deployment(ns).items
        return bool(dep.spec.replicas == 1)

    wait_for("scaled back once the spec is fixed", scaled_back, 90)
