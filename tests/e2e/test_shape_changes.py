"""End to end, a running service that changes shape leaves nothing of the old one behind, a
LeaderWorkerSet without LWS installed is said on the LLMService, and a group starts without its
headless worker reported as an agent that does not answer.

The four switches (one pod ↔ StatefulSet groups, StatefulSet ↔ LeaderWorkerSet, LeaderWorkerSet →
one pod): each old shape's objects deleted and the new shape's applied. The sandbox runs no LWS
controller, so the LeaderWorkerSet cases install LWS v0.10.0's vendored CRD only (the object
exists, is applied, deleted and re-applied; no pods come of it), and the StatefulSet cases that
only check objects run with no node (their pods stay Pending). The group start runs on a node:
Llama-3.1-70B at TP8 × PP2 over two pods, one group.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_operator.core.names import group_service_name, lws_name, service_name
from rankguard_operator.core.render.leader_worker_set import LWS_GROUP, LWS_PLURAL, LWS_VERSION
from rankguard_sim.kube.cluster import ControlPlane
from tests.builders import llmservice

from .conftest import GROUP, PLURAL, VERSION, apply_service, condition, get_llmservice, wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
LWS_CRD = REPO / "third_party" / "lws" / "v0.10.0" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
LWS_CRD_NAME = f"{LWS_PLURAL}.{LWS_GROUP}"
NAME = "shape"
GROUPS_SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-70B-Instruct"},
    "image": "vllm/vllm-openai:v0.33.0",
    "replicas": 1,
    "tensorParallelSize": 8,
    "pipelineParallelSize": 2,
    "distributed": {"podsPerGroup": 2, "timeoutSeconds": 60},
    "engine": {"maxModelLen": 8192},
    "memory": {"gpuMemoryUtilization": 0.9},
}


def one_pod() -> dict[str, Any]:
    spec = copy.deepcopy(GROUPS_SPEC)
    del spec["distributed"]
    return spec


def on_lws() -> dict[str, Any]:
    spec = copy.deepcopy(GROUPS_SPEC)
    spec["distributed"]["workload"] = "LeaderWorkerSet"
    return spec


# ------------------------------------------------------------------------------------ the API


def _reshape(api: client.ApiClient, ns: str, spec: dict[str, Any]) -> None:
    """Replace the whole spec (a merge patch could not drop `distributed`'s keys one by one)."""
    custom = client.CustomObjectsApi(api)
    live = custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, NAME)
    live["spec"] = spec
    custom.replace_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, NAME, live)


def _statefulsets(api: client.ApiClient, ns: str) -> list[str]:
    return sorted(s.metadata.name for s in client.AppsV1Api(api).list_namespaced_stateful_set(ns).items)


def _deployment(api: client.ApiClient, ns: str) -> Any:
    try:
        return client.AppsV1Api(api).read_namespaced_deployment(NAME, ns)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _headless(api: client.ApiClient, ns: str) -> Any:
    try:
        return client.CoreV1Api(api).read_namespaced_service(group_service_name(NAME), ns)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _lws(api: client.ApiClient, ns: str) -> dict[str, Any] | None:
    try:
        return dict(
            client.CustomObjectsApi(api).get_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, ns, LWS_PLURAL, lws_name(NAME)
            )
        )
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _controlled_by_service(obj: dict[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("controller") and r.get("kind") == "LLMService" and r.get("uid") == uid for r in refs)


def _shape_of(api: client.ApiClient, ns: str) -> dict[str, Any]:
    """What of each shape stands now (for a timeout's message)."""
    return {
        "deployment": _deployment(api, ns) is not None,
        "statefulsets": _statefulsets(api, ns),
        "headless": _headless(api, ns) is not None,
        "lws": _lws(api, ns) is not None,
        "status": (get_llmservice(api, ns, NAME).get("status") or {}).get("conditions"),
    }


def _wait_shape(api: client.ApiClient, ns: str, what: str, holds: Callable[[], bool]) -> None:
    wait_for(what, holds, 120, every=0.5, dump=lambda: _shape_of(api, ns))


# --------------------------------------------------------------------------------- LWS's CRD


def _crd_served(cluster: ControlPlane) -> bool:
    return cluster.kubectl("get", LWS_PLURAL, "-A", check=False).returncode == 0


def _install_lws_crd(cluster: ControlPlane) -> None:
    # server-side: at 1.3 MB it is too big for client-side apply's last-applied annotation
    cluster.kubectl("apply", "--server-side", "--field-manager=rankguard-tests", "-f", str(LWS_CRD))
    wait_for("API discovery to serve leaderworkersets", lambda: _crd_served(cluster), 60, every=0.3)


def _remove_lws_crd(cluster: ControlPlane) -> None:
    cluster.kubectl("delete", "crd", LWS_CRD_NAME, "--ignore-not-found", "--timeout=60s", check=False)
    wait_for("leaderworkersets no longer served", lambda: not _crd_served(cluster), 60, every=0.3)


@pytest.fixture
def lws_crd(cluster: ControlPlane) -> Iterator[None]:
    """LWS v0.10.0's CRD installed for the test (no controller: the object only), removed after
    unless it was there before."""
    had = _crd_served(cluster)
    if not had:
        _install_lws_crd(cluster)
    try:
        yield
    finally:
        if not had:
            _remove_lws_crd(cluster)


@pytest.fixture
def no_lws_crd(cluster: ControlPlane) -> Iterator[None]:
    """A cluster without LWS: its CRD removed for the test, put back after if it was there."""
    had = _crd_served(cluster)
    if had:
        _remove_lws_crd(cluster)
    try:
        yield
    finally:
        if had:
            _install_lws_crd(cluster)


# --------------------------------------------------------------------------------- the tests


def _created(api: client.ApiClient, ns: str, spec: dict[str, Any]) -> str:
    return str(apply_service(api, ns, llmservice(NAME, spec))["metadata"]["uid"])


def test_one_pod_to_groups_deletes_the_deployment(api: client.ApiClient, e2e_namespace: str) -> None:
    ns = e2e_namespace
    _created(api, ns, one_pod())
    _wait_shape(api, ns, "the one-pod service's Deployment", lambda: _deployment(api, ns) is not None)
    _reshape(api, ns, copy.deepcopy(GROUPS_SPEC))
    _wait_shape(
        api,
        ns,
        "the Deployment gone, the group's two StatefulSets and headless Service there",
        lambda: (
            _deployment(api, ns) is None
            and _statefulsets(api, ns) == [f"{NAME}-g0", f"{NAME}-g0-w"]
            and _headless(api, ns) is not None
        ),
    )


def test_statefulsets_to_a_leader_worker_set_delete_the_groups(
    api: client.ApiClient, e2e_namespace: str, lws_crd: None
) -> None:
    ns = e2e_namespace
    uid = _created(api, ns, copy.deepcopy(GROUPS_SPEC))
    _wait_shape(api, ns, "the group's StatefulSets", lambda: len(_statefulsets(api, ns)) == 2)
    _wait_shape(api, ns, "the headless Service", lambda: _headless(api, ns) is not None)
    _reshape(api, ns, on_lws())

    def switched() -> bool:
        lws = _lws(api, ns)
        return (
            lws is not None
            and _controlled_by_service(lws, uid)
            and _statefulsets(api, ns) == []
            and _headless(api, ns) is None
        )

    _wait_shape(api, ns, "the StatefulSets and headless Service gone, the LeaderWorkerSet there", switched)


@pytest.mark.parametrize("target", ["StatefulSet", "one pod"])
def test_a_leader_worker_set_is_deleted_when_the_service_leaves_it(
    api: client.ApiClient, e2e_namespace: str, lws_crd: None, target: str
) -> None:
    ns = e2e_namespace
    _created(api, ns, on_lws())
    _wait_shape(api, ns, "the LeaderWorkerSet", lambda: _lws(api, ns) is not None)
    if target == "StatefulSet":
        _reshape(api, ns, copy.deepcopy(GROUPS_SPEC))
        there = lambda: len(_statefulsets(api, ns)) == 2  # noqa: E731
    else:
        _reshape(api, ns, one_pod())
        there = lambda: _deployment(api, ns) is not None  # noqa: E731
    _wait_shape(
        api, ns, f"the LeaderWorkerSet gone, the {target} there", lambda: _lws(api, ns) is None and there()
    )
    # and status no longer records it (the operator stops reading it)
    _wait_shape(
        api,
        ns,
        "status.workloadHash cleared",
        lambda: "workloadHash" not in (get_llmservice(api, ns, NAME).get("status") or {}),
    )


def test_groups_to_one_pod_delete_the_sets_and_the_headless_service(
    api: client.ApiClient, e2e_namespace: str
) -> None:
    ns = e2e_namespace
    _created(api, ns, copy.deepcopy(GROUPS_SPEC))
    _wait_shape(
        api,
        ns,
        "the group's sets and headless Service",
        lambda: len(_statefulsets(api, ns)) == 2 and _headless(api, ns) is not None,
    )
    _reshape(api, ns, one_pod())
    _wait_shape(
        api,
        ns,
        "the StatefulSets and the headless Service gone, the Deployment there",
        lambda: (
            _statefulsets(api, ns) == [] and _headless(api, ns) is None and _deployment(api, ns) is not None
        ),
    )
    assert client.CoreV1Api(api).read_namespaced_service(service_name(NAME), ns) is not None


def test_an_object_of_the_old_shapes_name_it_does_not_control_is_left_alone(
    api: client.ApiClient, e2e_namespace: str
) -> None:
    """A `<name>-nodes` Service someone else made (no controller) survives the one-pod
    service's spec edits: only what this LLMService controls is deleted."""
    ns = e2e_namespace
    theirs = client.V1Service(
        metadata=client.V1ObjectMeta(name=group_service_name(NAME)),
        spec=client.V1ServiceSpec(cluster_ip="None", selector={"app": "theirs"}),
    )
    client.CoreV1Api(api).create_namespaced_service(ns, theirs)
    _created(api, ns, one_pod())
    _wait_shape(api, ns, "the one-pod service's Deployment", lambda: _deployment(api, ns) is not None)
    edited = one_pod()
    edited["engine"]["maxModelLen"] = 4096
    _reshape(api, ns, edited)

    def observed() -> bool:
        svc = get_llmservice(api, ns, NAME)
        generation = svc["metadata"]["generation"]
        return generation > 1 and (svc.get("status") or {}).get("observedGeneration") == generation

    _wait_shape(api, ns, "the edit observed", observed)
    assert _headless(api, ns) is not None


def test_a_leader_worker_set_deleted_by_hand_is_applied_again(
    api: client.ApiClient, e2e_namespace: str, lws_crd: None
) -> None:
    ns = e2e_namespace
    _created(api, ns, on_lws())
    first = wait_for("the LeaderWorkerSet", lambda: _lws(api, ns), 120, every=0.5)
    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        LWS_GROUP, LWS_VERSION, ns, LWS_PLURAL, lws_name(NAME)
    )

    def again() -> dict[str, Any] | None:
        lws = _lws(api, ns)
        return lws if lws is not None and lws["metadata"]["uid"] != first["metadata"]["uid"] else None

    wait_for("the LeaderWorkerSet applied again", again, 120, every=0.5, dump=lambda: _shape_of(api, ns))


def test_a_leader_worker_set_without_lws_installed_is_degraded_with_the_reason(
    api: client.ApiClient, e2e_namespace: str, no_lws_crd: None
) -> None:
    ns = e2e_namespace
    _created(api, ns, on_lws())

    def degraded() -> dict[str, Any] | None:
        c = condition(get_llmservice(api, ns, NAME), "Degraded")
        return c if c and c["status"] == "True" and c["reason"] == "LeaderWorkerSetMissing" else None

    said = wait_for(
        "Degraded LeaderWorkerSetMissing",
        degraded,
        120,
        dump=lambda: get_llmservice(api, ns, NAME).get("status"),
    )
    assert "LeaderWorkerSet v0.10" in said["message"] and "lws.sigs.k8s.io" in said["message"], said
    events = client.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={NAME}")
    assert any(e.reason == "LeaderWorkerSetMissing" and e.type == "Warning" for e in events.items)


SCENARIO = "llama3-70b-tp8-pp2-2nodes"


@pytest.mark.timeout(600)
def test_a_group_starts_without_its_worker_reported_agent_unavailable(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    """The headless worker is ready only once its agent listens (it probes its GPUs first), so
    AgentReady never turns False while the group starts (the session's bound is 15 s).

    With no spec.memory at all: the GPU's size then comes from the node's GPU Feature Discovery
    labels, which the operator reads from the nodes its pods run on. A group replace scales both
    sets to zero, and the render must not lose the size then (status.nodeGpu keeps it), or the
    template flips between two renders and the group is replaced for ever (issue 50: generation
    178 in 10 minutes, READY 0/1)."""
    ns = e2e_namespace
    make_node(SCENARIO, time_scale=4)
    spec = copy.deepcopy(GROUPS_SPEC)
    del spec["memory"]
    _created(api, ns, spec)
    seen: list[tuple[float, str, str]] = []

    def ready() -> dict[str, Any] | None:
        svc = get_llmservice(api, ns, NAME)
        agent = condition(svc, "AgentReady")
        if agent is not None:
            seen.append((time.monotonic(), agent["status"], agent["reason"]))
        st = svc.get("status") or {}
        fresh = [r for r in st.get("ranks") or [] if not r.get("stale")]
        ok = (condition(svc, "Ready") or {}).get("status") == "True"
        return svc if ok and agent and agent["status"] == "True" and len(fresh) == 16 else None

    svc = wait_for("the group Ready, every rank reporting", ready, 420, every=0.5, dump=lambda: seen[-5:])
    assert (svc["status"].get("nodeGpu") or {}).get("resource") == "nvidia.com/gpu", svc["status"]
    sets = client.AppsV1Api(api).list_namespaced_stateful_set(ns).items
    # the first render had no node to read (no pod yet): one replace to learn the size, no more
    assert sets and all(s.metadata.generation <= 4 for s in sets), [
        (s.metadata.name, s.metadata.generation) for s in sets
    ]
    worker = client.CoreV1Api(api).read_namespaced_pod(f"{NAME}-g0-w-1", ns)
    probe = worker.spec.containers[0].readiness_probe
    assert probe is not None and probe.tcp_socket is not None and probe.http_get is None
    events = client.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={NAME}")
    unavailable = [e.message for e in events.items if e.reason == "AgentUnavailable"]
    assert unavailable == [], unavailable
    assert all(status != "False" for _, status, _ in seen), seen
