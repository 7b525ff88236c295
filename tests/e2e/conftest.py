"""The whole loop: real API server, the operator as a subprocess, a process kubelet running the
agent and the fake vLLM. One operator per session (watching `e2e-*` namespaces only, so the
in-process operators of the cluster tests never meet it); one simulated node per test, with
that test's scenario, removed afterwards."""

from __future__ import annotations

import contextlib
import functools
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_operator.core.names import LLMSERVICE_LABEL
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.waiting import wait_for
from rankguard_sim.world import (
    Node,
    OperatorProcess,
    create_namespace,
    operator_running,
    start_node,
    wait_node_schedulable,
)

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "rankguard.io", "v1alpha1", "llmservices"
__all__ = [
    "GROUP",
    "PLURAL",
    "VERSION",
    "Sandbox",
    "apply_service",
    "condition",
    "example",
    "get_llmservice",
    "side_by_side",
    "wait_for",
]


@pytest.fixture(scope="session")
def operator_process(
    cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    # an agent missing for 15 s is reported (60 s by default), so that story runs in time
    env = {"RANKGUARD_WATCH_NAMESPACES": "e2e-*", "RANKGUARD_AGENT_UNAVAILABLE_AFTER": "15"}
    with operator_running(cluster, log, env) as op:
        yield op


@pytest.fixture
def e2e_namespace(api: client.ApiClient, operator_process: OperatorProcess) -> Iterator[str]:
    core = client.CoreV1Api(api)
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    create_namespace(api, name)
    try:
        yield name
    finally:
        # Delete the services first so their pods stop while the node still runs them.
        custom = client.CustomObjectsApi(api)
        for item in custom.list_namespaced_custom_object(GROUP, VERSION, name, PLURAL).get("items", []):
            try:
                custom.delete_namespaced_custom_object(GROUP, VERSION, name, PLURAL, item["metadata"]["name"])
            except ApiException as e:
                if e.status != 404:
                    raise
        core.delete_namespace(name)


@pytest.fixture
def make_node(api: client.ApiClient, tmp_path: Path) -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make(scenario: str, **kw: Any) -> Node:
        # a scenario is a built-in name or a YAML file's path; the node is named after it
        node = start_node(api, tmp_path, f"e2e-{Path(scenario).stem}-{uuid.uuid4().hex[:5]}", scenario, **kw)
        nodes.append(node)
        wait_node_schedulable(api, node.name)
        return node

    try:
        yield make
    finally:
        for n in nodes:
            n.stop()


@dataclass(frozen=True)
class Sandbox:
    """Several stories in one namespace, each on a simulated node of its own (keyed by story)."""

    api: client.ApiClient
    namespace: str
    nodes: dict[str, Node]


@contextlib.contextmanager
def side_by_side(
    api: client.ApiClient,
    workdir: Path,
    namespace: str,
    stories: Mapping[str, tuple[str, Callable[[str], dict[str, Any]]]],
) -> Iterator[Sandbox]:
    """Every story's node (key -> (scenario, the service on a node's name)) started first, then
    every service applied, so that all stories run at once (the e2e tier's time); afterwards the
    services go first, so their pods stop while the nodes still run them."""
    create_namespace(api, namespace)
    nodes: dict[str, Node] = {}
    try:
        for key, (scenario, _) in stories.items():
            nodes[key] = start_node(api, workdir, f"e2e-{key}-{uuid.uuid4().hex[:5]}", scenario, time_scale=4)
        for key, (_, service) in stories.items():
            wait_node_schedulable(api, nodes[key].name)
            apply_service(api, namespace, service(nodes[key].name))
        yield Sandbox(api, namespace, nodes)
    finally:
        custom = client.CustomObjectsApi(api)
        for key in stories:
            try:
                custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, key)
            except ApiException as e:
                if e.status != 404:
                    raise
        client.CoreV1Api(api).delete_namespace(namespace)
        for node in nodes.values():
            node.stop()  # its neighbours too


def apply_service(api: client.ApiClient, namespace: str, doc: dict[str, Any]) -> dict[str, Any]:
    return dict(
        client.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    )


def get_llmservice(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    return dict(
        client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    )


def example(name: str = "llama3-70b-tp4.yaml") -> dict[str, Any]:
    return dict(yaml.safe_load((REPO / "examples" / name).read_text()))


def condition(svc: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (svc.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return None


def serving_pods(api: client.ApiClient, namespace: str) -> dict[str, Any]:
    """The LLMServices' pods of the namespace that are not being deleted, by name."""
    items = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=LLMSERVICE_LABEL).items
    return {p.metadata.name: p for p in items if p.metadata.deletion_timestamp is None}


def ready_groups(
    api: client.ApiClient, namespace: str, name: str, *, groups: int, ranks: int, budget: int | None = None
) -> dict[str, Any] | None:
    """The service when all its `groups` are Ready (with `budget` in effect, when given) and
    `ranks` ranks report fresh figures."""
    svc = get_llmservice(api, namespace, name)
    st = svc.get("status") or {}
    c = condition(svc, "Ready")
    if not (c and c["status"] == "True" and st.get("ready") == f"{groups}/{groups}"):
        return None
    if budget is not None and (st.get("servingFlags") or {}).get("kvCacheMemoryBytes") != budget:
        return None
    fresh = [r for r in st.get("ranks") or [] if not r.get("stale")]
    return svc if len(fresh) == ranks else None


def degraded_as(api: client.ApiClient, ns: str, name: str, reason: str) -> dict[str, Any] | None:
    svc = get_llmservice(api, ns, name)
    d = condition(svc, "Degraded")
    return svc if d and d["status"] == "True" and d["reason"] == reason else None


def wait_degraded(api: client.ApiClient, ns: str, name: str, reason: str, timeout: float) -> dict[str, Any]:
    """Wait for Degraded=True with `reason`, and return the service."""
    svc: dict[str, Any] = wait_for(
        f"{name} Degraded {reason}",
        functools.partial(degraded_as, api, ns, name, reason),
        timeout,
        dump=lambda: get_llmservice(api, ns, name).get("status"),
    )
    return svc


def events(api: client.ApiClient, ns: str, name: str, reason: str) -> list[Any]:
    return list(
        client.CoreV1Api(api)
        .list_namespaced_event(ns, field_selector=f"involvedObject.name={name},reason={reason}")
        .items
    )


def deployments(api: client.ApiClient, ns: str) -> list[Any]:
    return list(client.AppsV1Api(api).list_namespaced_deployment(ns).items)
