"""The LeaderWorkerSet rankguard renders, held against LWS's published API on a real
kube-apiserver. (Over 450 lines because it is one fixture, LWS's CRD installed, and every check
made against it.) LWS v0.10.0's CRD (vendored in third_party/lws/) installed, then a rendered
object server-side dry-run applied (dryRun=All, fieldValidation=Strict, field manager
rankguard) and accepted; a misspelled field, in the LWS spec or deep in a pod template, refused
with an error naming it, so the check can fail. LWS's controller and webhooks cannot run here
(third_party/lws/README.md): their rules are tests/unit/core/render/test_lws_rules.py's, and the
StatefulSets its controller would make from the templates are dry-run created by hand below.

The owner reference points at a real LLMService (created first), so the uid is one the API
server could garbage-collect by.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from operator_world import GROUP, IMAGE, PLURAL, VERSION, assert_subset, service_doc

from rankguard_operator.core.names import AGENT_ENTRY, NODE_RANK_ENV, VLLM_CONTAINER, VLLM_HTTP_PORT, labels
from rankguard_operator.core.render.leader_worker_set import (
    GROUP_INDEX_LABEL,
    GROUP_KEY_LABEL,
    GROUP_SIZE_ENV,
    LEADER_ADDRESS_ENV,
    LEADER_NAME_ANNOTATION,
    LWS_GROUP,
    LWS_PLURAL,
    LWS_VERSION,
    MASTER_ADDR_ARG,
    SET_NAME_LABEL,
    SIZE_ANNOTATION,
    SUBDOMAIN_POLICY_ANNOTATION,
    TEMPLATE_REVISION_LABEL,
    WORKER_INDEX_ENV,
    WORKER_INDEX_LABEL,
    node_rank_env,
    render_leader_worker_set,
)
from rankguard_operator.core.render.lws_rules import lws_problems
from rankguard_operator.edge.k8s import FIELD_MANAGER
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
LWS_CRD = REPO / "third_party" / "lws" / "v0.10.0" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
CRD_NAME = f"{LWS_PLURAL}.{LWS_GROUP}"
APPLY = "application/apply-patch+yaml"
# An unknown field in an apply patch: kube-apiserver (1.34) answers HTTP 500 "failed to create
# typed patch object (...): <path>: field not declared in schema", whatever fieldValidation says
# (kubernetes/kubernetes#139253, open; PR #139255 would make it 400).
SCHEMA_REFUSAL = (400, 500)

SERVICE = "llama-405b"
MODEL = "meta-llama/Llama-3.1-405B-Instruct"
NODES = 2  # pods per group: TP 8 on each node, PP 2 across them
GROUPS = 2


@pytest.fixture(scope="module")
def lws_crd(cluster: ControlPlane) -> Iterator[str]:
    """LWS's CRD installed (server-side: at 1.3 MB it is too big for client-side apply's
    last-applied annotation) and served, like install_crd does for our own; removed after."""
    cluster.kubectl("apply", "--server-side", "--field-manager=rankguard-tests", "-f", str(LWS_CRD))
    wait_for(
        "the LeaderWorkerSet CRD to be Established",
        lambda: (
            cluster.kubectl(
                "get",
                f"crd/{CRD_NAME}",
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                check=False,
            ).stdout.strip()
            == "True"
        ),
        60,
        every=0.3,
    )
    wait_for(
        "API discovery to serve leaderworkersets",
        lambda: cluster.kubectl("get", LWS_PLURAL, "-A", check=False).returncode == 0,
        60,
        every=0.3,
    )
    try:
        yield CRD_NAME
    finally:
        cluster.kubectl("delete", "crd", CRD_NAME, "--wait=false", check=False)


@pytest.fixture
def owner(api: client.ApiClient, crd: str, namespace: str) -> dict[str, Any]:
    """A real LLMService for the LeaderWorkerSet's owner reference (no operator runs here)."""
    doc = service_doc(SERVICE, agent_port=9400)
    created = client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, doc
    )
    return dict(created)


# --------------------------------------------------------------------------------------------
# Pod templates as the group renderer will make them (by hand until it exists)


def pod_template(*, worker: bool) -> dict[str, Any]:
    vllm = ["vllm", "serve", MODEL, "--tensor-parallel-size", "8", "--pipeline-parallel-size", str(NODES)]
    vllm += ["--nnodes", str(NODES), "--node-rank", f"$({NODE_RANK_ENV})"]
    vllm += ["--master-addr", MASTER_ADDR_ARG, "--master-port", "29500"]
    vllm += ["--headless"] if worker else ["--host", "0.0.0.0", "--port", str(VLLM_HTTP_PORT)]
    container: dict[str, Any] = {
        "name": VLLM_CONTAINER,
        "image": IMAGE,
        "command": ["python3", AGENT_ENTRY, "launch", "--port", "9400", "--", *vllm],
        "env": [
            node_rank_env(),
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
            {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"},
            {"name": "VLLM_HOST_IP", "value": "$(POD_IP)"},
        ],
        "ports": [{"name": "agent", "containerPort": 9400}],
        "resources": {
            "requests": {"nvidia.com/gpu": "8", "cpu": "32", "memory": "512Gi"},
            "limits": {"nvidia.com/gpu": "8", "memory": "768Gi"},
        },
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if not worker:
        container["ports"].insert(0, {"name": "http", "containerPort": VLLM_HTTP_PORT})
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10}
    return {
        "metadata": {
            "labels": {**labels(SERVICE), "rankguard.io/role": "worker" if worker else "leader"},
            "annotations": {"rankguard.io/template-hash": "0123abcd"},
        },
        "spec": {
            "containers": [container],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}],
            "terminationGracePeriodSeconds": 60,
        },
    }


def rendered(namespace: str, owner_uid: str) -> dict[str, Any]:
    return render_leader_worker_set(
        SERVICE,
        namespace,
        owner_uid,
        replicas=GROUPS,
        size=NODES,
        leader_template=pod_template(worker=False),
        worker_template=pod_template(worker=True),
        labels=labels(SERVICE),
        revision_annotations={"rankguard.io/template-hash": "0123abcd"},
    )


def apply_lws(api: client.ApiClient, obj: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
    """Server-side apply as the operator's edge does (its field manager, forced, unknown fields
    refused); `dry_run`: the API server only says what it would store."""
    meta = obj["metadata"]
    response = client.CustomObjectsApi(api).patch_namespaced_custom_object(
        LWS_GROUP,
        LWS_VERSION,
        meta["namespace"],
        LWS_PLURAL,
        meta["name"],
        obj,
        **({"dry_run": "All"} if dry_run else {}),
        field_manager=FIELD_MANAGER,
        field_validation="Strict",
        force=True,
        _content_type=APPLY,
        # The generated client reads a body only from HTTP 200 of this call; an apply that
        # creates answers 201 and would come back as None.
        _preload_content=False,
    )
    return dict(json.loads(response.data))


def dry_run_apply(api: client.ApiClient, obj: dict[str, Any]) -> dict[str, Any]:
    return apply_lws(api, obj, dry_run=True)


def refusal(api: client.ApiClient, obj: dict[str, Any]) -> tuple[int, str]:
    """The HTTP status and the message of the API server's refusal of `obj`."""
    with pytest.raises(ApiException) as e:
        dry_run_apply(api, obj)
    return e.value.status, str(json.loads(e.value.body)["message"])


# --------------------------------------------------------------------------------------------


def test_the_rendered_leader_worker_set_is_accepted(
    api: client.ApiClient, lws_crd: str, namespace: str, owner: dict[str, Any]
) -> None:
    obj = rendered(namespace, owner["metadata"]["uid"])
    assert lws_problems(obj) == []  # what LWS's webhook would say, which this server cannot
    sent = copy.deepcopy(obj)

    live = dry_run_apply(api, obj)

    assert obj == sent  # the client sent it unchanged
    assert live["metadata"]["ownerReferences"] == obj["metadata"]["ownerReferences"]
    assert live["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    spec = live["spec"]
    # everything rendered survived the schema unchanged (nothing pruned; the CRD's schema adds
    # defaults such as a port's protocol) ...
    assert_subset(obj["spec"], spec, ".spec")
    assert (spec["replicas"], spec["leaderWorkerTemplate"]["size"]) == (GROUPS, NODES)
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    # ... and the CRD's defaults filled the rest, as lws_rules.defaulted assumes
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxUnavailable": 1,
        "maxSurge": 0,
        "partition": 0,
    }
    worker = spec["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    assert (
        worker["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{WORKER_INDEX_LABEL}']"
    )
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == "8"
    # a dry run: nothing was stored
    with pytest.raises(ApiException) as e:
        client.CustomObjectsApi(api).get_namespaced_custom_object(
            LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, obj["metadata"]["name"]
        )
    assert e.value.status == 404


def test_a_misspelled_lws_field_is_refused_naming_it(
    api: client.ApiClient, lws_crd: str, namespace: str, owner: dict[str, Any]
) -> None:
    obj = rendered(namespace, owner["metadata"]["uid"])
    lwt = obj["spec"]["leaderWorkerTemplate"]
    lwt["sizee"] = lwt.pop("size")
    status, body = refusal(api, obj)
    assert status in SCHEMA_REFUSAL, body
    assert ".spec.leaderWorkerTemplate.sizee: field not declared in schema" in body, body


def test_a_misspelled_field_in_a_pod_template_is_refused_naming_it(
    api: client.ApiClient, lws_crd: str, namespace: str, owner: dict[str, Any]
) -> None:
    obj = rendered(namespace, owner["metadata"]["uid"])
    env = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["env"][0]
    env["valueFrom"]["fieldReff"] = env["valueFrom"].pop("fieldRef")
    status, body = refusal(api, obj)
    assert status in SCHEMA_REFUSAL, body
    assert ".spec.leaderWorkerTemplate.workerTemplate.spec.containers[name=" in body, body
    assert 'env[name="RANKGUARD_NODE_RANK"].valueFrom.fieldReff: field not declared in schema' in body, body


def test_a_wrong_enum_is_refused_by_the_schema(
    api: client.ApiClient, lws_crd: str, namespace: str, owner: dict[str, Any]
) -> None:
    obj = rendered(namespace, owner["metadata"]["uid"])
    obj["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnPodRestrat"
    status, body = refusal(api, obj)
    assert status == 422, body
    assert "spec.leaderWorkerTemplate.restartPolicy" in body and "supported values" in body, body


# --------------------------------------------------------------------------------------------
# What LWS's controller would make of it (pkg/controllers at v0.10.0), by hand: the leaders'
# StatefulSet, one group's workers' StatefulSet and one worker pod as its pod webhook admits
# it, dry-run created, so the core API validates the pod templates themselves (container and
# env names, the downward API field path, quantities), which the CRD's schema does not.


def _leader_statefulset(lws: dict[str, Any]) -> dict[str, Any]:
    name, lwt = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    template = copy.deepcopy(lwt["leaderTemplate"])
    template["metadata"]["labels"] |= {
        WORKER_INDEX_LABEL: "0",
        SET_NAME_LABEL: name,
        TEMPLATE_REVISION_LABEL: "r1",
    }
    template["metadata"]["annotations"] |= {
        SIZE_ANNOTATION: str(lwt["size"]),
        SUBDOMAIN_POLICY_ANNOTATION: "UniquePerReplica",
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "labels": {SET_NAME_LABEL: name}},
        "spec": {
            "replicas": lws["spec"]["replicas"],
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {SET_NAME_LABEL: name, WORKER_INDEX_LABEL: "0"}},
            "template": template,
        },
    }


def _worker_statefulset(lws: dict[str, Any], group: int) -> dict[str, Any]:
    name, lwt = lws["metadata"]["name"], lws["spec"]["leaderWorkerTemplate"]
    leader = f"{name}-{group}"
    selector = {SET_NAME_LABEL: name, GROUP_INDEX_LABEL: str(group), GROUP_KEY_LABEL: "0" * 40}
    template = copy.deepcopy(lwt["workerTemplate"])
    template["metadata"]["labels"] |= selector | {TEMPLATE_REVISION_LABEL: "r1"}
    template["metadata"]["annotations"] |= {SIZE_ANNOTATION: str(lwt["size"]), LEADER_NAME_ANNOTATION: leader}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": leader, "labels": {SET_NAME_LABEL: name}},
        "spec": {
            "replicas": lwt["size"] - 1,
            "serviceName": leader,  # UniquePerReplica: the group's own headless Service
            "podManagementPolicy": "Parallel",
            "ordinals": {"start": 1},
            "selector": {"matchLabels": selector},
            "template": template,
        },
    }


def _worker_pod(lws: dict[str, Any], group: int, rank: int) -> dict[str, Any]:
    sts = _worker_statefulset(lws, group)
    name, leader = lws["metadata"]["name"], sts["metadata"]["name"]
    template = sts["spec"]["template"]
    pod_spec = copy.deepcopy(template["spec"])
    pod_spec |= {"hostname": f"{leader}-{rank}", "subdomain": leader}
    injected = [
        {"name": LEADER_ADDRESS_ENV, "value": f"{name}-{group}.{leader}.{lws['metadata']['namespace']}"},
        {"name": GROUP_SIZE_ENV, "value": str(lws["spec"]["leaderWorkerTemplate"]["size"])},
        {"name": WORKER_INDEX_ENV, "value": str(rank)},
    ]
    for c in pod_spec["containers"]:
        c["env"] = injected + c.get("env", [])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{leader}-{rank}",
            "labels": template["metadata"]["labels"] | {WORKER_INDEX_LABEL: str(rank)},
            "annotations": template["metadata"]["annotations"],
        },
        "spec": pod_spec,
    }


def test_what_the_lws_controller_would_make_of_it_passes_the_core_api(
    api: client.ApiClient, namespace: str
) -> None:
    lws = rendered(namespace, "not-applied")
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    strict = {"dry_run": "All", "field_validation": "Strict"}
    apps.create_namespaced_stateful_set(namespace, _leader_statefulset(lws), **strict)
    apps.create_namespaced_stateful_set(namespace, _worker_statefulset(lws, group=1), **strict)
    pod = _worker_pod(lws, group=1, rank=NODES - 1)
    created = core.create_namespaced_pod(namespace, pod, **strict)
    env = created.spec.containers[0].env
    assert [e.name for e in env[:4]] == [
        LEADER_ADDRESS_ENV,
        GROUP_SIZE_ENV,
        WORKER_INDEX_ENV,
        NODE_RANK_ENV,
    ]
    assert env[0].value == f"{SERVICE}-1.{SERVICE}-1.{namespace}"
    assert created.metadata.labels[WORKER_INDEX_LABEL] == str(NODES - 1)

    # and the same check fails when a template is wrong: a downward-API path the API refuses
    broken = copy.deepcopy(lws)
    worker = broken["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    worker["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] = "metadata.labels['bad key!']"
    with pytest.raises(ApiException) as e:
        apps.create_namespaced_stateful_set(namespace, _worker_statefulset(broken, group=1), **strict)
    assert e.value.status == 422
    message = json.loads(e.value.body)["message"]
    assert "spec.template.spec.containers[0].env[0].valueFrom.fieldRef" in message, message
    assert "bad key!" in message, message


# --------------------------------------------------------------------------------------------
# Every example, as the operator renders it multi-node


EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _multi_node(doc: dict[str, Any], workload: str) -> dict[str, Any]:
    """The example's LLMService as a multi-node service: its own spec.distributed, else two pods
    a group (with at least two GPUs a replica)."""
    out = copy.deepcopy(doc)
    spec = out["spec"]
    if spec.get("tensorParallelSize", 1) * spec.get("pipelineParallelSize", 1) < 2:
        spec["tensorParallelSize"] = 2
    spec["distributed"] = {"podsPerGroup": 2, **(spec.get("distributed") or {}), "workload": workload}
    return out


def _apply_core(api: client.ApiClient, obj: dict[str, Any]) -> None:
    """Server-side apply dry run of a core-API object (a StatefulSet, a Service), strict."""
    meta = obj["metadata"]
    call = (
        client.AppsV1Api(api).patch_namespaced_stateful_set
        if obj["kind"] == "StatefulSet"
        else client.CoreV1Api(api).patch_namespaced_service
    )
    call(
        meta["name"],
        meta["namespace"],
        obj,
        dry_run="All",
        field_manager=FIELD_MANAGER,
        field_validation="Strict",
        force=True,
        _content_type=APPLY,
    )


WORKLOADS = ["StatefulSet", "LeaderWorkerSet"]
CASES = [(p, w) for p in EXAMPLES for w in WORKLOADS]


@pytest.mark.parametrize("case", CASES, ids=[f"{p.name}-{w}" for p, w in CASES])
def test_every_example_rendered_multi_node_passes_server_side_dry_run(
    api: client.ApiClient, lws_crd: str, namespace: str, owner: dict[str, Any], case: tuple[Path, str]
) -> None:
    """Each example's LLMService, rendered by the operator's own first pass as a multi-node
    service, is accepted object by object (strict field validation): the StatefulSets and the
    headless Service by the core API, the LeaderWorkerSet by LWS's published schema and its
    webhook's rules."""
    import yaml

    from rankguard_operator.cli_render import render_service

    path, workload = case
    services = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "LLMService"]
    assert services
    for doc in services:
        objects, refused = render_service(
            _multi_node(doc, workload), namespace=namespace, agent_image=IMAGE, gpu_memory_bytes=80 * 2**30
        )
        assert refused == [], refused
        kinds = sorted({o["kind"] for o in objects} - {"PersistentVolumeClaim"})
        assert kinds == (
            ["Service", "StatefulSet"] if workload == "StatefulSet" else ["LeaderWorkerSet", "Service"]
        )
        for rendered_obj in objects:
            obj = copy.deepcopy(rendered_obj)
            obj["metadata"]["ownerReferences"][0]["uid"] = owner["metadata"]["uid"]
            if obj["kind"] == "LeaderWorkerSet":
                assert lws_problems(obj) == []
                size = obj["spec"]["leaderWorkerTemplate"]["size"]
                assert dry_run_apply(api, obj)["spec"]["leaderWorkerTemplate"]["size"] == size
            elif obj["kind"] in ("StatefulSet", "Service"):
                _apply_core(api, obj)
