"""Fault drills (docs/reliability.md): the whole loop, broken on purpose.

The drills get their own control plane, never the session `cluster` of tests/conftest.py:
the outage drills stop its API server and etcd, and the kill drill runs a dozen services at
once. `fault_cp` is shared by the drills that leave the control plane intact (kill, forged
pods, flapping OOMs); `fresh_cp` is one per outage drill, because an outage leaves the
sandbox's simulated node NotReady for good (the process kubelet does not re-assert its Ready
condition or its pods' readiness once the node lifecycle controller marked them Unknown).

Each drill gets a `Drill`: its own namespace, its own simulated node(s) and its own operator
process, which watches that namespace only (an exact name: no namespace scan).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families

from rankguard_operator.core.names import REMEDIATION_ID_ANNOTATION
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.kubelet.kubelet import ProcessKubelet
from rankguard_sim.waiting import wait_for
from rankguard_sim.world import OperatorProcess, create_namespace, install_crd, wait_node_schedulable

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "rankguard.io", "v1alpha1", "llmservices"
REVISION_ANNOTATION = "deployment.kubernetes.io/revision"
SCENARIO = "llama3-70b-tp4"
GPUS_PER_SERVICE = 4  # the scenario's TP4; maxSurge 0, so a roll needs no second set
# The sandbox runs the engine's start-up and load this many times faster (as tests/e2e do).
TIME_SCALE = 4.0


@pytest.fixture(scope="session")
def fault_cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane.start(tmp_path_factory.mktemp("fault-cp"))
    try:
        install_crd(cp)
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def fresh_cp(tmp_path: Path) -> Iterator[ControlPlane]:
    cp = ControlPlane.start(tmp_path / "cp")
    try:
        install_crd(cp)
        yield cp
    finally:
        cp.stop()


@dataclass
class Drill:
    """One drill's namespace, nodes and operator on a control plane; `close()` undoes them."""

    cp: ControlPlane
    api: client.ApiClient
    namespace: str
    workdir: Path
    nodes: list[ProcessKubelet] = field(default_factory=list)
    operator: OperatorProcess | None = None

    # ------------------------------------------------------------------ the world
    def start_node(self, services: int, scenario: str = SCENARIO) -> ProcessKubelet:
        """A simulated GPU node with room for `services` TP4 services (and one spare set of
        GPUs), CPU and memory enough for any number of pods: the drills count rolls, not
        scheduling."""
        name = f"{self.namespace}-n{len(self.nodes)}"
        kubelet = ProcessKubelet(
            self.api,
            name,
            workdir=self.workdir / name,
            gpu_root=self.workdir / name / "gpus",
            gpus=GPUS_PER_SERVICE * (services + 1),
            scenario=scenario,
            backoff_base=0.5,
            backoff_cap=5.0,
            cpu="1000",
            memory="64Ti",
            delete_node_on_stop=True,
            extra_env={"RANKGUARD_SIM_TIME_SCALE": str(TIME_SCALE)},
        )
        self.nodes.append(kubelet)
        kubelet.start()
        wait_node_schedulable(self.api, name)
        return kubelet

    def start_operator(self, *, metrics: bool = False) -> OperatorProcess:
        op = OperatorProcess(
            self.cp.kubeconfig,
            self.workdir / "operator.log",
            # A Running service passes on its agents' news and every resync (issue 31); a drill's
            # "the loop looked" counts passes, so as often as the scrape interval (as the cluster
            # tier's conftest does).
            env_extra={"RANKGUARD_WATCH_NAMESPACES": self.namespace, "RANKGUARD_RESYNC_INTERVAL": "2"},
            metrics=metrics,
        )
        self.operator = op
        op.start()
        op.wait_ready()
        return op

    @property
    def op(self) -> OperatorProcess:
        assert self.operator is not None, "start_operator() first"
        return self.operator

    # ------------------------------------------------------------------ reads
    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    def create_service(self, doc: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, doc)

    def service(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name))

    def services(self) -> dict[str, dict[str, Any]]:
        items = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL)["items"]
        return {str(i["metadata"]["name"]): dict(i) for i in items}

    def deployment(self, name: str) -> dict[str, Any] | None:
        try:
            dep = client.AppsV1Api(self.api).read_namespaced_deployment(name, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return dict(self.api.sanitize_for_serialization(dep))

    def deployments(self) -> dict[str, dict[str, Any]]:
        items = client.AppsV1Api(self.api).list_namespaced_deployment(self.namespace).items
        return {d.metadata.name: dict(self.api.sanitize_for_serialization(d)) for d in items}

    def pods(self) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_pod(self.namespace).items
        return [dict(self.api.sanitize_for_serialization(p)) for p in items]

    def replicasets_of(self, deployment: dict[str, Any]) -> list[dict[str, Any]]:
        uid = deployment["metadata"]["uid"]
        items = client.AppsV1Api(self.api).list_namespaced_replica_set(self.namespace).items
        return [
            dict(self.api.sanitize_for_serialization(rs))
            for rs in items
            if any(ref.uid == uid for ref in rs.metadata.owner_references or [])
        ]

    def events(self, service: str) -> list[Any]:
        selector = f"involvedObject.name={service},involvedObject.kind=LLMService"
        return list(self.core.list_namespaced_event(self.namespace, field_selector=selector).items)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of one metric's samples whose labels include `labels` (0 when none)."""
        total = 0.0
        for family in text_string_to_metric_families(self.op.metrics_text()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def passes(self, service: str) -> float:
        return self.metric("rankguard_operator_passes_total", namespace=self.namespace, llmservice=service)

    def dump(self) -> dict[str, Any]:
        """What a failed wait shows: every service's status, and the operator log's tail."""
        tail = self.op.log.read_text(errors="replace").splitlines()[-40:] if self.operator else []
        return {
            "status": {n: s.get("status") for n, s in self.services().items()},
            "operator_log_tail": tail,
        }

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        # Services first, so their pods stop while the node still runs them.
        for name in self.services():
            try:
                self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
            except ApiException as e:
                if e.status != 404:
                    raise
        for node in self.nodes:
            node.stop()
        if self.operator is not None:
            self.operator.stop()
        try:
            self.core.delete_namespace(self.namespace)
        except ApiException as e:
            if e.status != 404:
                raise


def _drill(cp: ControlPlane, workdir: Path, prefix: str) -> Iterator[Drill]:
    api = cp.api_client()
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    create_namespace(api, namespace, {"rankguard.io/test": "faults"})
    drill = Drill(cp, api, namespace, workdir)
    try:
        yield drill
    finally:
        # After an outage drill the control plane itself is about to go: its cleanup is that.
        if cp.component("etcd").alive() and cp.component("kube-apiserver").alive():
            drill.close()
        else:
            for node in drill.nodes:
                node.stop()
            if drill.operator is not None:
                drill.operator.stop()
        api.close()


@pytest.fixture
def drill(fault_cp: ControlPlane, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Drill]:
    yield from _drill(fault_cp, tmp_path, _prefix(request))


@pytest.fixture
def outage_drill(fresh_cp: ControlPlane, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Drill]:
    yield from _drill(fresh_cp, tmp_path, _prefix(request))


def _prefix(request: pytest.FixtureRequest) -> str:
    base = request.node.name.lower().removeprefix("test_").replace("_", "-")
    return "f-" + "".join(c for c in base if c.isalnum() or c == "-")[:30].strip("-")


# ---------------------------------------------------------------------------------- helpers
def service_doc(name: str, *, start_at_default: bool = True, **remediation: Any) -> dict[str, Any]:
    """examples/llama3-70b-tp4.yaml under another name. `start_at_default`: vLLM's default
    utilisation 0.92, which runs rank 0 out of memory under load (the CUDA OOM story); else
    rankguard plans the budget from the start and the service serves without a crash."""
    doc: dict[str, Any] = yaml.safe_load((REPO / "examples" / "llama3-70b-tp4.yaml").read_text())
    doc["metadata"] = {"name": name}
    spec = doc["spec"]
    if not start_at_default:
        del spec["memory"]["gpuMemoryUtilization"]
    # No start-up probe: it runs one torch process per rank, which a dozen services on two
    # cores cannot afford, and no drill is about what it measures.
    spec["agent"]["probe"] = False
    spec["remediation"].update(remediation)
    return doc


def condition(svc: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (svc.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_:
            return dict(c)
    return None


def is_ready(svc: dict[str, Any]) -> bool:
    c = condition(svc, "Ready")
    return bool(c and c.get("status") == "True")


def revision(deployment: dict[str, Any] | None) -> int:
    """The Deployment controller's revision: 1 when created, +1 for every new pod template."""
    raw = ((deployment or {}).get("metadata") or {}).get("annotations", {}).get(REVISION_ANNOTATION)
    return int(raw) if raw else 0


def remediation_id(deployment: dict[str, Any] | None) -> str | None:
    ann = ((deployment or {}).get("metadata") or {}).get("annotations") or {}
    value = ann.get(REMEDIATION_ID_ANNOTATION)
    return str(value) if value else None


def settled(deployment: dict[str, Any] | None) -> bool:
    """The Deployment controller has seen the latest spec (so the revision annotation is final)."""
    if deployment is None:
        return False
    observed = (deployment.get("status") or {}).get("observedGeneration")
    return bool(observed == deployment["metadata"].get("generation"))


def wait_observed(d: Drill, name: str, timeout: float = 60) -> dict[str, Any]:
    """The Deployment of `name` once its controller has seen its latest spec."""

    def observed() -> dict[str, Any] | None:
        dep = d.deployment(name)
        return dep if settled(dep) else None

    result: dict[str, Any] = wait_for(f"the Deployment {name} observed by its controller", observed, timeout)
    return result


def wait_settled(d: Drill, names: list[str], timeout: float = 120) -> dict[str, dict[str, Any]]:
    def all_settled() -> dict[str, dict[str, Any]] | None:
        deps = d.deployments()
        return deps if all(settled(deps.get(n)) for n in names) else None

    result: dict[str, dict[str, Any]] = wait_for("the Deployments to be observed", all_settled, timeout)
    return result


__all__ = [
    "GROUP",
    "PLURAL",
    "VERSION",
    "Drill",
    "condition",
    "is_ready",
    "remediation_id",
    "revision",
    "service_doc",
    "settled",
    "wait_for",
    "wait_observed",
    "wait_settled",
]
