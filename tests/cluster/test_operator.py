"""The operator itself, under kopf's KopfRunner, against the real API server.

(Over 450 lines because every test shares one harness, the in-process operator and a test
playing the kubelet through pods/status; the step's own paths are unit-tested without it.)

Each test starts the real operator in this process (the kopf CLI, our handlers module),
watching only a namespace of its own (`op-…`), so it never meets the e2e suite's operator
subprocess (which watches `e2e-*`). There is no node: the test plays the kubelet, writing pod
status through the pods/status subresource exactly as a kubelet would (container statuses with
`lastState.terminated`, restart counts, Ready conditions, pod IPs), and plays the agent with
an aiohttp server on 127.0.0.1 where a pod's `/report` would be.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import pytest
from aiohttp import web
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client import REGISTRY

from rankguard_agent import termination as tm
from rankguard_agent.report import MAX_REPORT_BYTES, RankSample, Report
from rankguard_operator.core import render
from rankguard_operator.core.budget import prior_plan
from rankguard_operator.core.flags import ServingFlags
from rankguard_operator.core.names import FLAGS_ANNOTATION, REMEDIATION_ID_ANNOTATION, VLLM_CONTAINER
from rankguard_operator.core.spec import parse_spec
from rankguard_operator.core.units import parse_bytes
from rankguard_operator.edge import k8s
from rankguard_operator.edge.config import DEFAULT_AGENT_IMAGE
from rankguard_sim.cluster import ControlPlane, free_port
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "rankguard.io", "v1alpha1", "llmservices"
GiB, MiB = 1 << 30, 1 << 20
SCRAPE_INTERVAL = 0.5
# "Nothing happened" must mean the loop looked: this many passes after the event in question.
QUIET_PASSES = 4
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
IMAGE = "vllm/vllm-openai:v0.33.0"
SERVICE_LABEL = "rankguard.io/llmservice"
HOLD_FINALIZER = "rankguard.io/test-graceful-termination"
SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"


# --------------------------------------------------------------------------------------------
# Waiting


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------------------------
# Fixtures: a namespace the in-process operator alone watches, and the operator itself


@pytest.fixture
def op_namespace(api: client.ApiClient, crd: str) -> Iterator[str]:
    core = client.CoreV1Api(api)
    name = f"op-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name, "labels": {"rankguard.io/test": "true"}}})
    # The ReplicaSet controller cannot create pods before the default ServiceAccount exists.
    wait_for("the default ServiceAccount", lambda: _has_default_sa(core, name))
    try:
        yield name
    finally:
        # The operator is stopped by now, so nothing would ever remove kopf's finalizer (or the
        # test's own hold on a pod): drop them, or the namespace would never go away.
        custom = client.CustomObjectsApi(api)
        for item in custom.list_namespaced_custom_object(GROUP, VERSION, name, PLURAL).get("items", []):
            with contextlib.suppress(ApiException):
                custom.patch_namespaced_custom_object(
                    GROUP,
                    VERSION,
                    name,
                    PLURAL,
                    item["metadata"]["name"],
                    {"metadata": {"finalizers": None}},
                    _content_type=MERGE,
                )
        for pod in core.list_namespaced_pod(name).items:
            if pod.metadata.finalizers:
                with contextlib.suppress(ApiException):
                    core.patch_namespaced_pod(
                        pod.metadata.name, name, {"metadata": {"finalizers": None}}, _content_type=MERGE
                    )
        with contextlib.suppress(ApiException):
            core.delete_namespace(name)


def _has_default_sa(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.read_namespaced_service_account("default", namespace)
    except ApiException as e:
        if e.status != 404:
            raise
        return False
    return True


@pytest.fixture
def operator_env(cluster: ControlPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `python -m rankguard_operator` gets from its environment, for an in-process run."""
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.setenv("RANKGUARD_METRICS_PORT", "0")
    monkeypatch.setenv("RANKGUARD_SCRAPE_INTERVAL", str(SCRAPE_INTERVAL))
    # Idle services pass only on events or every resync; "the loop looked" (QUIET_PASSES) needs
    # passes while the pods here sit unscheduled (this test plays the kubelet), so as often.
    monkeypatch.setenv("RANKGUARD_RESYNC_INTERVAL", str(SCRAPE_INTERVAL))
    # The kubernetes client reads KUBECONFIG once, when it is imported (long before this test);
    # k8s.login() calls load_kube_config() without a path, so point the default at our cluster.
    monkeypatch.setattr("kubernetes.config.kube_config.KUBE_CONFIG_DEFAULT_LOCATION", str(cluster.kubeconfig))


@contextlib.contextmanager
def operator(namespace: str) -> Iterator[KopfRunner]:
    """The real operator (kopf CLI + rankguard_operator.edge.handlers) in a thread of this process."""
    args = ["run", "--standalone", "--namespace", namespace, "-m", "rankguard_operator.edge.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        yield runner
    assert runner.exit_code == 0, runner.output[-4000:]


# --------------------------------------------------------------------------------------------
# The LLMService and what the operator made of it


def service_doc(name: str, agent_port: int, **spec: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": MODEL},
            "image": IMAGE,
            "tensorParallelSize": 2,
            "engine": {"maxModelLen": 8192, "maxNumSeqs": 64},
            "memory": {"gpuMemoryBytes": 80 * GiB},
            # No cooldown: a second roll must be prevented by deduplication, not by waiting.
            "remediation": {"cooldownSeconds": 0, "maxHostMemory": "64Gi"},
            "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
            "agent": {"port": agent_port},
        },
    }
    doc["spec"].update(spec)
    return doc


class World:
    """One test's namespace as seen through the API, plus the kubelet's and agent's parts."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api, self.ns = api, namespace
        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    def as_dict(self, obj: Any) -> dict[str, Any]:
        return dict(self.api.sanitize_for_serialization(obj))

    # LLMService ------------------------------------------------------------------------------
    def create(self, doc: Mapping[str, Any]) -> dict[str, Any]:
        return dict(self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, dict(doc)))

    def svc(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name))

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.svc(name).get("status") or {})

    def patch_status(self, name: str, patch: Mapping[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.ns, PLURAL, name, {"status": dict(patch)}, _content_type=MERGE
        )

    def passes(self, name: str) -> float:
        """Passes the in-process operator's loop has made for `name` (its own metric)."""
        value = REGISTRY.get_sample_value(
            "rankguard_operator_passes_total", {"namespace": self.ns, "llmservice": name}
        )
        return value or 0.0

    def let_the_loop_look(self, name: str, passes: int = QUIET_PASSES) -> None:
        """Before asserting that nothing happened: wait until the loop has made `passes` more
        passes, so "nothing" means it looked (a stalled loop would fail here, not pass)."""
        start = self.passes(name)
        wait_for(f"{passes} more passes of {name}'s loop", lambda: self.passes(name) >= start + passes)

    def condition(self, name: str, type_: str) -> dict[str, Any]:
        for c in self.status(name).get("conditions") or []:
            if c.get("type") == type_:
                return dict(c)
        return {}

    def warning_events(self, name: str) -> list[dict[str, Any]]:
        events = self.core.list_namespaced_event(
            self.ns, field_selector=f"involvedObject.kind=LLMService,involvedObject.name={name}"
        )
        return [self.as_dict(e) for e in events.items if e.type == "Warning"]

    # Deployment ------------------------------------------------------------------------------
    def deployment(self, name: str) -> dict[str, Any] | None:
        try:
            return self.as_dict(self.apps.read_namespaced_deployment(name, self.ns))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def generation(self, name: str) -> int:
        d = self.deployment(name)
        assert d is not None
        return int(d["metadata"]["generation"])

    def ready_service(self, name: str) -> dict[str, Any]:
        """Wait until the operator rendered the service and settled on its first flags."""
        wait_for("the Deployment", lambda: self.deployment(name))
        return dict(
            wait_for(
                "the first status",
                lambda: (s := self.status(name)).get("servingFlags") and s.get("observedGeneration") and s,
            )
        )

    # Pods: the kubelet's part ----------------------------------------------------------------
    def pods(self, name: str) -> list[dict[str, Any]]:
        items = self.core.list_namespaced_pod(self.ns, label_selector=f"{SERVICE_LABEL}={name}").items
        return [self.as_dict(p) for p in items]

    def pod(self, pod_name: str) -> dict[str, Any]:
        return self.as_dict(self.core.read_namespaced_pod(pod_name, self.ns))

    def new_pod(self, name: str, not_in: tuple[str, ...] = ()) -> dict[str, Any]:
        """Wait for a live pod of the service that is not one of `not_in`."""

        def find() -> dict[str, Any] | None:
            for p in self.pods(name):
                if p["metadata"]["name"] not in not_in and not p["metadata"].get("deletionTimestamp"):
                    return p
            return None

        return dict(wait_for("a pod from the ReplicaSet", find))

    def patch_pod(self, pod_name: str, patch: Mapping[str, Any], content_type: str = SMP) -> None:
        self.core.patch_namespaced_pod(pod_name, self.ns, dict(patch), _content_type=content_type)

    def set_pod_status(self, pod_name: str, status: Mapping[str, Any]) -> None:
        # A kubelet writes status with a strategic merge patch: conditions merge by type, so the
        # scheduler's PodScheduled condition stays as it is.
        self.core.patch_namespaced_pod_status(pod_name, self.ns, {"status": dict(status)}, _content_type=SMP)

    def kubelet_ready(self, pod_name: str, ip: str = "127.0.0.1") -> None:
        t = now_iso()
        self.set_pod_status(
            pod_name,
            {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "startTime": t,
                "conditions": [
                    {"type": "Initialized", "status": "True", "lastTransitionTime": t},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": t},
                    {"type": "Ready", "status": "True", "lastTransitionTime": t},
                ],
                "containerStatuses": [
                    {
                        "name": VLLM_CONTAINER,
                        "image": IMAGE,
                        "imageID": "",
                        "containerID": f"containerd://{uuid.uuid4().hex}",
                        "ready": True,
                        "started": True,
                        "restartCount": 0,
                        "state": {"running": {"startedAt": t}},
                    }
                ],
            },
        )

    def kubelet_terminated(
        self, pod_name: str, terminated: Mapping[str, Any], *, restarted: bool = True
    ) -> None:
        """The vLLM container's first run ended. `restarted`: as the kubelet reports it once the
        container is waiting to restart (the run in lastState, restartCount 1); otherwise as it
        reports it at the moment the run ended (the run in state, restartCount 0)."""
        t = now_iso()
        run = {"containerID": f"containerd://{pod_name}-0", "startedAt": t, "finishedAt": t, **terminated}
        container: dict[str, Any] = {
            "name": VLLM_CONTAINER,
            "image": IMAGE,
            "imageID": "",
            "ready": False,
            "started": False,
        }
        if restarted:
            container.update(
                restartCount=1,
                lastState={"terminated": run},
                state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting"}},
            )
        else:
            container.update(restartCount=0, state={"terminated": run})
        self.set_pod_status(
            pod_name,
            {
                "phase": "Running",
                "conditions": [
                    {"type": "ContainersReady", "status": "False", "lastTransitionTime": t},
                    {"type": "Ready", "status": "False", "lastTransitionTime": t},
                ],
                "containerStatuses": [container],
            },
        )


@pytest.fixture
def world(api: client.ApiClient, op_namespace: str, operator_env: None) -> World:
    return World(api, op_namespace)


def vllm_container(deployment: Mapping[str, Any]) -> dict[str, Any]:
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        if c["name"] == VLLM_CONTAINER:
            return dict(c)
    raise AssertionError("the Deployment has no vllm container")


def kv_flag(deployment: Mapping[str, Any]) -> int:
    command = vllm_container(deployment)["command"]
    return int(command[command.index("--kv-cache-memory-bytes") + 1])


def cuda_oom(rank: int, requested: int, free: int) -> dict[str, Any]:
    """A kubelet's `terminated` record of a vLLM run the agent saw die of a CUDA OOM."""
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=rank,
        gpu_index=rank,
        requested_bytes=requested,
        free_bytes=free,
        total_bytes=80 * GiB,
        detail=(
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {requested / GiB:.2f} GiB. "
            f"GPU {rank} has a total capacity of 79.19 GiB of which {free / GiB:.2f} GiB is free."
        ),
    ).to_json()
    return {"exitCode": 1, "reason": "Error", "message": message}


def assert_subset(want: Any, live: Any, path: str = "") -> None:
    """Every field rankguard rendered is in the live object with the same value (the API server
    adds defaults such as a probe's successThreshold, which rankguard does not own)."""
    if isinstance(want, Mapping):
        assert isinstance(live, Mapping), f"{path}: {live!r} is not an object"
        for key, value in want.items():
            assert key in live, f"{path}.{key} is missing from the live object"
            assert_subset(value, live[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(live, list) and len(live) == len(want), f"{path}: {live!r} != {want!r}"
        for i, (w, v) in enumerate(zip(want, live, strict=True)):
            assert_subset(w, v, f"{path}[{i}]")
    else:
        assert want == live, f"{path}: live {live!r} != rendered {want!r}"


def managed_by(obj: Mapping[str, Any], manager: str) -> list[dict[str, Any]]:
    return [dict(m) for m in obj["metadata"].get("managedFields") or [] if m.get("manager") == manager]


def owns(fields: Mapping[str, Any], *path: str) -> bool:
    node: Any = fields
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return False
        node = node[key]
    return True


# --------------------------------------------------------------------------------------------
# The agent's part: /report served from a thread of its own (the test thread blocks on the API)


class ReportServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self._body: Callable[[], bytes] = lambda: b""
        self._status = 200
        self.requests = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def serve(self, body: bytes | Callable[[], bytes], status: int = 200) -> None:
        self._body = body if callable(body) else (lambda: body)
        self._status = status

    async def _report(self, request: web.Request) -> web.Response:
        self.requests += 1
        return web.Response(body=self._body(), status=self._status, content_type="application/json")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/report", self._report)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> ReportServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def valid_report(min_free: tuple[int, ...], total: int = 80 * GiB) -> bytes:
    """A fresh agent report: rank r has kept at least min_free[r] free over its window."""
    ranks = [
        RankSample(
            rank=r,
            uuid=f"GPU-{r:08d}-test",
            total_bytes=total,
            used_bytes=total - (m + GiB),
            free_bytes=m + GiB,
            min_free_bytes=m,
            window_seconds=10.0,
        )
        for r, m in enumerate(min_free)
    ]
    return Report(version=1, agent_version="0.1.0", timestamp=time.time(), ranks=ranks).to_json()


def rejected(namespace: str, name: str, reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "rankguard_operator_reports_rejected_total",
        {"namespace": namespace, "llmservice": name, "reason": reason},
    )
    return value or 0.0


def rejected_twice_since(namespace: str, name: str, reason: str, start: float) -> bool:
    # Two at least: the first might have been a scrape in flight with the previous body.
    return rejected(namespace, name, reason) >= start + 2


def accepted(namespace: str, name: str) -> float:
    value = REGISTRY.get_sample_value(
        "rankguard_operator_reports_accepted_total", {"namespace": namespace, "llmservice": name}
    )
    return value or 0.0


# --------------------------------------------------------------------------------------------
# 1. Apply an LLMService: the Deployment and Service exactly as rendered, owned by rankguard


def test_applied_service_renders_the_deployment_and_service_it_owns(
    world: World, cluster: ControlPlane
) -> None:
    port = free_port()
    with operator(world.ns):
        created = world.create(service_doc("svc", port))
        status = world.ready_service("svc")
        wait_for("the Service", lambda: world.core.list_namespaced_service(world.ns).items)
        svc = world.svc("svc")
        spec = parse_spec(svc["spec"])  # as the API server defaulted it
        flags = ServingFlags.from_status(status["servingFlags"])
        assert flags is not None
        # The first budget is the planner's, from the spec's GPU size (no agent has reported yet).
        plan = prior_plan(spec)
        assert plan is not None and flags.kv_cache_memory_bytes == plan.kv_cache_memory_bytes
        uid = created["metadata"]["uid"]
        want = render.render_deployment(
            "svc", world.ns, uid, spec, flags, agent_image=DEFAULT_AGENT_IMAGE, plan=plan
        )
        live = world.deployment("svc")
        assert live is not None
        assert_subset(want, live)

        # The fields that matter, spelled out (assert_subset would accept extra list items).
        container = vllm_container(live)
        want_container = want["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == want_container["command"]
        assert container["command"][:3] == ["python3", "/opt/rankguard/agent/rankguard-agent", "launch"]
        assert container["command"][container["command"].index("--") + 1 :][:3] == ["vllm", "serve", MODEL]
        assert kv_flag(live) == plan.kv_cache_memory_bytes
        assert container["resources"] == {
            "requests": {"nvidia.com/gpu": "2", "cpu": "4", "memory": "16Gi"},
            "limits": {"nvidia.com/gpu": "2", "memory": "32Gi"},
        }
        assert container["env"] == want_container["env"]
        assert {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"} in container["env"]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert {"name": "agent", "containerPort": port, "protocol": "TCP"} in container["ports"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert (
            container["startupProbe"]["failureThreshold"]
            == want_container["startupProbe"]["failureThreshold"]
        )
        assert live["metadata"]["labels"] == want["metadata"]["labels"]
        assert live["metadata"]["ownerReferences"] == [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "LLMService",
                "name": "svc",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        template_annotations = live["spec"]["template"]["metadata"]["annotations"]
        assert template_annotations == want["spec"]["template"]["metadata"]["annotations"]
        assert json.loads(template_annotations[FLAGS_ANNOTATION]) == flags.to_status()

        service = world.core.read_namespaced_service("svc", world.ns)
        live_service = world.as_dict(service)
        want_service = render.render_service("svc", world.ns, uid, spec)
        assert_subset(want_service, live_service)
        assert live_service["spec"]["selector"] == {"app.kubernetes.io/name": "vllm", SERVICE_LABEL: "svc"}
        assert [(p["name"], p["port"], p["targetPort"]) for p in live_service["spec"]["ports"]] == [
            ("http", 8000, "http"),
            ("agent", port, "agent"),
        ]

        # Server-side apply: the field manager "rankguard" owns what it rendered.
        for obj in (live, live_service):
            entries = managed_by(obj, k8s.FIELD_MANAGER)
            assert [m["operation"] for m in entries] == ["Apply"], obj["metadata"].get("managedFields")
        fields = managed_by(live, k8s.FIELD_MANAGER)[0]["fieldsV1"]
        vllm_key = 'k:{"name":"vllm"}'
        template_spec = ("f:spec", "f:template", "f:spec", "f:containers", vllm_key)
        assert owns(fields, *template_spec, "f:command")
        assert owns(fields, *template_spec, "f:resources", "f:limits", "f:nvidia.com/gpu")
        assert owns(fields, "f:metadata", "f:ownerReferences")
        assert owns(managed_by(live_service, k8s.FIELD_MANAGER)[0]["fieldsV1"], "f:spec", "f:ports")

        # A person's edits to fields rankguard does not own survive its next apply.
        cluster.kubectl("label", "deployment", "svc", "-n", world.ns, "team=inference")
        cluster.kubectl("annotate", "deployment", "svc", "-n", world.ns, "example.com/oncall=platform")
        generation = world.generation("svc")
        world.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            world.ns,
            PLURAL,
            "svc",
            {"spec": {"engine": {"extraArgs": ["--enable-prefix-caching"]}}},
            _content_type=MERGE,
        )
        live = wait_for(
            "the operator to apply the new spec",
            lambda: (
                (d := world.deployment("svc"))
                and "--enable-prefix-caching" in vllm_container(d)["command"]
                and world.status("svc").get("observedGeneration") == 2
                and d
            ),
        )
        assert live["metadata"]["generation"] == generation + 1
        assert live["metadata"]["labels"]["team"] == "inference"
        assert live["metadata"]["annotations"]["example.com/oncall"] == "platform"
        assert vllm_container(live)["command"][-1] == "--enable-prefix-caching"
        fields = managed_by(live, k8s.FIELD_MANAGER)[0]["fieldsV1"]
        assert not owns(fields, "f:metadata", "f:labels", "f:team")
        assert owns(fields, "f:metadata", "f:labels", f"f:{SERVICE_LABEL}")


# --------------------------------------------------------------------------------------------
# 2. CUDA OOM on rank 0: one roll with a smaller budget, one Event, one history entry, then Ready


def test_cuda_oom_on_rank0_rolls_once_to_a_smaller_budget_then_ready(world: World) -> None:
    with operator(world.ns):
        world.create(service_doc("svc", free_port()))
        world.ready_service("svc")
        before = world.deployment("svc")
        assert before is not None
        old_kv, generation = kv_flag(before), int(before["metadata"]["generation"])
        pod = world.new_pod("svc")["metadata"]["name"]

        # rank 0 asked for 2 GiB with 1.5 GiB free: a 512 MiB deficit, plus the default 512 MiB
        # safety margin, so the budget must drop by at least 1 GiB (rounded down to whole blocks).
        world.kubelet_terminated(pod, cuda_oom(rank=0, requested=2 * GiB, free=3 * GiB // 2))
        rolled = wait_for(
            "the Deployment to roll",
            lambda: (d := world.deployment("svc")) and d["metadata"]["generation"] > generation and d,
        )
        new_kv = kv_flag(rolled)
        assert old_kv - GiB - 64 * MiB < new_kv <= old_kv - GiB, (old_kv, new_kv)
        assert rolled["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION]

        status = wait_for(
            "the remediation in status",
            lambda: (s := world.status("svc")).get("remediations") and not s.get("pendingRemediation") and s,
        )
        [entry] = status["remediations"]
        assert entry["trigger"] == "CUDAOutOfMemory" and entry["action"] == "ShrinkKVCache"
        assert entry["rank"] == 0
        assert entry["fromFlags"]["kvCacheMemoryBytes"] == old_kv
        assert entry["toFlags"]["kvCacheMemoryBytes"] == new_kv
        assert status["servingFlags"] == {"kvCacheMemoryBytes": new_kv}
        remediating = world.condition("svc", "Remediating")
        assert remediating["status"] == "True", remediating
        assert status["phase"] == "Remediating"
        events = wait_for("the Warning Event", lambda: world.warning_events("svc"))
        assert [e["reason"] for e in events] == ["ShrankKVCache"]
        assert "rank 0 ran out of GPU memory" in events[0]["message"]

        # The kubelet starts the new pod and it becomes Ready: the service is Ready again.
        new_pod = world.new_pod("svc", not_in=(pod,))
        assert kv_flag({"spec": {"template": {"spec": new_pod["spec"]}}}) == new_kv  # the new template
        world.kubelet_ready(new_pod["metadata"]["name"])
        wait_for("Ready True", lambda: world.condition("svc", "Ready").get("status") == "True")
        status = world.status("svc")
        assert status["phase"] == "Running"
        assert world.condition("svc", "Remediating")["status"] == "False"
        assert status["ready"] == "1/1"

        # Still exactly one roll, one history entry and one Warning Event.
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation + 1
        assert len(world.status("svc")["remediations"]) == 1
        assert [e["reason"] for e in world.warning_events("svc")] == ["ShrankKVCache"]


# --------------------------------------------------------------------------------------------
# 3. The same termination delivered again: no second roll


def test_the_same_termination_delivered_again_does_not_roll_again(world: World) -> None:
    with operator(world.ns):
        world.create(service_doc("svc", free_port()))
        world.ready_service("svc")
        generation = world.generation("svc")
        pod = world.new_pod("svc")["metadata"]["name"]
        # Stands for the kubelet's graceful termination: the deleted pod (and its status) stays
        # visible for a while after the roll, and keeps sending events.
        world.patch_pod(pod, {"metadata": {"finalizers": [HOLD_FINALIZER]}})

        # First as the kubelet reports a run the moment it ends: in `state`, restartCount 0.
        oom = cuda_oom(rank=0, requested=2 * GiB, free=GiB)
        world.kubelet_terminated(pod, oom, restarted=False)
        wait_for("the roll", lambda: world.generation("svc") == generation + 1)
        wait_for("the old pod to be terminating", lambda: world.pod(pod)["metadata"].get("deletionTimestamp"))
        wait_for("the status", lambda: not world.status("svc").get("pendingRemediation"))

        # The same run again, as reported after the restart (lastState, restartCount 1), on a pod
        # whose metadata changed: a new event for the same termination.
        world.patch_pod(pod, {"metadata": {"annotations": {"example.com/touched": "1"}}})
        world.kubelet_terminated(pod, oom, restarted=True)
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation + 1

        # Once more, with the pod no longer saying which flags it ran: only the record of handled
        # terminations (status.handledTerminations) now stands between this event and a roll.
        world.patch_pod(
            pod, {"metadata": {"annotations": {FLAGS_ANNOTATION: None, "example.com/touched": "2"}}}
        )
        world.kubelet_terminated(pod, oom, restarted=True)
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation + 1
        status = world.status("svc")
        assert len(status["remediations"]) == 1
        uid = world.pod(pod)["metadata"]["uid"]
        assert f"{uid}/vllm/0" in status["handledTerminations"]
        assert [e["reason"] for e in world.warning_events("svc")] == ["ShrankKVCache"]
        world.patch_pod(pod, {"metadata": {"finalizers": None}}, content_type=MERGE)


# --------------------------------------------------------------------------------------------
# 4. The operator restarted between the decision and the patch: exactly one roll


def pending_remediation(
    rid: str, from_flags: ServingFlags, to_flags: ServingFlags, key: str
) -> dict[str, Any]:
    """What a crashed operator leaves: the decision, written before the roll it never made."""
    return {
        "id": rid,
        "kind": "shrink",
        "startedAt": now_iso(),
        "fromFlags": from_flags.to_status(),
        "toFlags": to_flags.to_status(),
        "terminations": [key],
    }


def test_restart_between_the_decision_and_the_patch_rolls_exactly_once(world: World) -> None:
    with operator(world.ns):
        world.create(service_doc("svc", free_port()))
        status = world.ready_service("svc")
        pod = world.new_pod("svc")
    current = ServingFlags.from_status(status["servingFlags"])
    assert current is not None and current.kv_cache_memory_bytes is not None
    target = current.with_kv(current.kv_cache_memory_bytes - 2 * GiB)
    key = f"{pod['metadata']['uid']}/vllm/0"
    generation = world.generation("svc")
    world.patch_status("svc", {"pendingRemediation": pending_remediation("rg-0001", current, target, key)})

    with operator(world.ns):
        status = wait_for(
            "the pending remediation to be finished",
            lambda: (s := world.status("svc")) and not s.get("pendingRemediation") and s,
        )
        world.let_the_loop_look("svc")
        rolled = world.deployment("svc")
        assert rolled is not None
        assert rolled["metadata"]["generation"] == generation + 1
        assert rolled["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == "rg-0001"
        assert kv_flag(rolled) == target.kv_cache_memory_bytes
        status = world.status("svc")
        assert status["servingFlags"] == target.to_status()
        assert key in status["handledTerminations"]
        assert "pendingRemediation" not in status
        replica_sets = world.apps.list_namespaced_replica_set(world.ns).items
        assert len(replica_sets) == 2  # the first render and the one roll


def test_restart_after_the_patch_does_not_roll_again(world: World) -> None:
    with operator(world.ns):
        created = world.create(service_doc("svc", free_port()))
        status = world.ready_service("svc")
        pod = world.new_pod("svc")
    current = ServingFlags.from_status(status["servingFlags"])
    assert current is not None and current.kv_cache_memory_bytes is not None
    target = current.with_kv(current.kv_cache_memory_bytes - 2 * GiB)
    key = f"{pod['metadata']['uid']}/vllm/0"
    world.patch_status("svc", {"pendingRemediation": pending_remediation("rg-0002", current, target, key)})
    # The crashed operator had already rolled: the Deployment it applied carries the id.
    spec = parse_spec(world.svc("svc")["spec"])
    applied = render.render_deployment(
        "svc",
        world.ns,
        created["metadata"]["uid"],
        spec,
        target,
        agent_image=DEFAULT_AGENT_IMAGE,
        plan=prior_plan(spec),
        revision_annotations={REMEDIATION_ID_ANNOTATION: "rg-0002"},
    )
    world.apps.patch_namespaced_deployment(
        "svc",
        world.ns,
        applied,
        field_manager=k8s.FIELD_MANAGER,
        force=True,
        _content_type="application/apply-patch+yaml",
    )
    generation = world.generation("svc")

    with operator(world.ns):
        wait_for(
            "the pending remediation to be cleared", lambda: not world.status("svc").get("pendingRemediation")
        )
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation
        live = world.deployment("svc")
        assert live is not None and kv_flag(live) == target.kv_cache_memory_bytes
        status = world.status("svc")
        assert status["servingFlags"] == target.to_status()
        assert key in status["handledTerminations"]


def test_crash_after_writing_the_decision_is_finished_by_the_next_operator(world: World) -> None:
    """The same story with the real decision: the operator writes its intent, then its roll is
    refused by the API server (a ValidatingAdmissionPolicy, as a cluster's own policy might)
    until it is stopped; the next operator rolls exactly once and records the change."""
    admission = client.AdmissionregistrationV1Api(world.api)
    policy_name = f"refuse-rankguard-rolls-{world.ns}"
    admission.create_validating_admission_policy(
        {
            "metadata": {"name": policy_name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["UPDATE"],
                         "resources": ["deployments"]}
                    ]
                },
                "validations": [
                    {
                        "expression": "!has(object.metadata.annotations) || "
                        f"!('{REMEDIATION_ID_ANNOTATION}' in object.metadata.annotations)",
                        "message": "remediation rolls are frozen in this namespace",
                    }
                ],
            },
        }
    )  # fmt: skip
    admission.create_validating_admission_policy_binding(
        {
            "metadata": {"name": policy_name},
            "spec": {
                "policyName": policy_name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": world.ns}}
                },
            },
        }
    )
    # Admission policies take effect a moment after they are created: wait until one bites.
    world.apps.create_namespaced_deployment(
        world.ns,
        {
            "metadata": {"name": "vap-probe"},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": "vap-probe"}},
                "template": {
                    "metadata": {"labels": {"app": "vap-probe"}},
                    "spec": {"containers": [{"name": "c", "image": "example.invalid/c:1"}]},
                },
            },
        },
    )

    def refused() -> bool:
        try:
            world.apps.patch_namespaced_deployment(
                "vap-probe",
                world.ns,
                {"metadata": {"annotations": {REMEDIATION_ID_ANNOTATION: "x"}}},
                dry_run="All",
            )
        except ApiException as e:
            return e.status in (400, 403, 422)
        return False

    wait_for("the admission policy to take effect", refused)
    try:
        with operator(world.ns):
            world.create(service_doc("svc", free_port()))
            world.ready_service("svc")
            generation = world.generation("svc")
            pod = world.new_pod("svc")["metadata"]["name"]
            world.kubelet_terminated(pod, cuda_oom(rank=0, requested=3 * GiB, free=GiB))
            pending = wait_for(
                "the decision in status", lambda: world.status("svc").get("pendingRemediation")
            )
            # The refusal is on the LLMService, in the API server's words (before: logged every
            # pass, with no condition and no Event).
            degraded = wait_for(
                "the refusal as a condition",
                lambda: (c := world.condition("svc", "Degraded")).get("reason") == "ApplyRefused" and c,
            )
            assert degraded["status"] == "True"
            assert "remediation rolls are frozen in this namespace" in degraded["message"]
            world.let_the_loop_look("svc")
            refusals = [e for e in world.warning_events("svc") if e["reason"] == "ApplyRefused"]
            assert len(refusals) == 1, refusals  # once, not once per pass
            assert world.status("svc")["pendingRemediation"]["id"] == pending["id"]  # the same one
        assert world.generation("svc") == generation  # the roll never landed
        assert not world.status("svc").get("remediations")  # nor was it recorded as done
    finally:
        admission.delete_validating_admission_policy_binding(policy_name)
        admission.delete_validating_admission_policy(policy_name)

    with operator(world.ns):
        wait_for(
            "the pending remediation to be finished",
            lambda: not world.status("svc").get("pendingRemediation"),
        )
        world.let_the_loop_look("svc")
        rolled = world.deployment("svc")
        assert rolled is not None
        assert rolled["metadata"]["generation"] == generation + 1
        assert rolled["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == pending["id"]
        assert kv_flag(rolled) == pending["toFlags"]["kvCacheMemoryBytes"]
        assert kv_flag(rolled) < pending["fromFlags"]["kvCacheMemoryBytes"]
        st = world.status("svc")
        assert st["servingFlags"] == pending["toFlags"]
        # Recorded once, under the id of the roll, even though the deciding operator died.
        assert [h["revision"] for h in st["remediations"]] == [pending["id"]]
        assert st["remediations"][0]["trigger"] == "CUDAOutOfMemory"


# --------------------------------------------------------------------------------------------
# 5. OOMKilled: the container memory limit is raised the way the VPA does


def test_oomkilled_raises_the_memory_limit(world: World) -> None:
    with operator(world.ns):
        world.create(service_doc("svc", free_port()))
        world.ready_service("svc")
        before = world.deployment("svc")
        assert before is not None
        generation = world.generation("svc")
        pod = world.new_pod("svc")["metadata"]["name"]
        # The kernel killed the container at its limit; the launcher could write nothing, so the
        # kubelet fell back to the log tail (FallbackToLogsOnError).
        world.kubelet_terminated(
            pod,
            {
                "exitCode": 137,
                "reason": "OOMKilled",
                "message": "INFO 11-29 22:00:00 Loading safetensors checkpoint shards: 50% Completed | 2/4",
            },
        )
        rolled = wait_for(
            "the memory limit to be raised",
            lambda: (d := world.deployment("svc")) and d["metadata"]["generation"] > generation and d,
        )
        resources = vllm_container(rolled)["resources"]
        # 32Gi limit: max(32Gi + 100Mi, 32Gi × 1.2 = 39321.6Mi), rounded up to whole MiB.
        assert parse_bytes(resources["limits"]["memory"]) == 39322 * MiB
        assert resources["requests"]["memory"] == "16Gi"
        assert resources["limits"]["nvidia.com/gpu"] == "2"
        assert kv_flag(rolled) == kv_flag(before)  # GPU memory had nothing to do with it
        status = wait_for("the history entry", lambda: (s := world.status("svc")).get("remediations") and s)
        [entry] = status["remediations"]
        assert entry["trigger"] == "OOMKilled" and entry["action"] == "BumpMemoryLimit"
        world.let_the_loop_look("svc")
        assert world.generation("svc") == generation + 1


# --------------------------------------------------------------------------------------------
# 6. `kubectl get llmservice` shows the columns, from real scraped figures


def columns(table: str) -> dict[str, str]:
    """The first row of a kubectl table, by header (cells may contain spaces: "rank 1")."""
    header, row = table.splitlines()[:2]
    cells = list(re.finditer(r"\S+", header))
    ends = [c.start() for c in cells[1:]] + [len(row)]
    return {c.group(): row[c.start() : end].strip() for c, end in zip(cells, ends, strict=True)}


def test_kubectl_get_shows_the_columns_filled(world: World, cluster: ControlPlane) -> None:
    port = free_port()
    with ReportServer(port) as agent, operator(world.ns):
        # Rank 1, not rank 0, has the least headroom: the columns must say so.
        agent.serve(lambda: valid_report((3 * GiB, 2 * GiB)))
        world.create(service_doc("svc", port))
        world.ready_service("svc")
        world.kubelet_ready(world.new_pod("svc")["metadata"]["name"])
        status = wait_for(
            "ranks in status and Ready",
            lambda: (
                (s := world.status("svc")).get("ranks")
                and world.condition("svc", "Ready").get("status") == "True"
                and s
            ),
        )
        assert agent.requests > 0
        got = columns(cluster.kubectl("get", "llmservice", "svc", "-n", world.ns).stdout)
        assert got == {
            "NAME": "svc",
            "MODEL": MODEL,
            "TP": "2",
            "READY": "1/1",
            "KV-BUDGET": status["kvBudget"],
            "RANK0": "3Gi",
            "MIN-HEADROOM": "2Gi",
            "BOTTLENECK": "rank 1",
            "PHASE": "Running",
            "AGE": got["AGE"],
        }
        assert got["KV-BUDGET"].endswith("Gi") and float(got["KV-BUDGET"][:-2]) > 0
        assert [(r["rank"], r["minFreeBytes"]) for r in status["ranks"]] == [(0, 3 * GiB), (1, 2 * GiB)]


# --------------------------------------------------------------------------------------------
# 7. Bad reports are counted, ignored, and survived


def _report_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(valid_report((3 * GiB, 2 * GiB)))
    doc.update(changes)
    return doc


def _rank_doc(**changes: Any) -> dict[str, Any]:
    rank: dict[str, Any] = json.loads(valid_report((3 * GiB,)))["ranks"][0]
    rank.update(changes)
    return rank


def dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def hostile_reports() -> list[tuple[str, bytes, int, str]]:
    """(what, body, HTTP status, the reason it must be counted under)."""
    head = b'{"version":1,"agent_version":"x","timestamp":'
    nested = head + b'1,"ranks":' + b"[" * 60_000 + b"]" * 60_000 + b"}"
    negative = _rank_doc(free_bytes=-1, min_free_bytes=-1)
    huge_digits = head + b"9" * 5000 + b',"ranks":[]}'
    return [
        ("truncated JSON", b'{"version": 1, "ranks": [{"rank": 0, ', 200, "malformed"),
        ("an HTML error page", b"<html><body>502 Bad Gateway</body></html>", 200, "malformed"),
        ("an HTTP error", b"{}", 500, "http-status"),
        ("oversized", dumps(_report_doc(agent_version="x" * (MAX_REPORT_BYTES + 1))), 200, "oversized"),
        ("deeply nested JSON", nested, 200, "malformed"),
        ("ranks of the wrong type", dumps(_report_doc(ranks={"0": "lots"})), 200, "malformed"),
        ("a string where a number goes", dumps(_report_doc(timestamp="now")), 200, "malformed"),
        ("negative free memory", dumps(_report_doc(ranks=[negative])), 200, "malformed"),
        ("a petabyte GPU", dumps(_report_doc(ranks=[_rank_doc(total_bytes=10**30)])), 200, "malformed"),
        # Python refuses integers of more than 4300 digits with a ValueError, not a JSON error.
        ("a 5000-digit integer", huge_digits, 200, "malformed"),
    ]


def test_malformed_oversized_and_hostile_reports_are_counted_and_ignored(world: World) -> None:
    port = free_port()
    ns = world.ns
    with ReportServer(port) as agent, operator(ns):
        agent.serve(b"", status=503)
        world.create(service_doc("svc", port))
        world.ready_service("svc")
        world.kubelet_ready(world.new_pod("svc")["metadata"]["name"])
        wait_for("Ready True", lambda: world.condition("svc", "Ready").get("status") == "True")
        generation = world.generation("svc")

        for what, body, http_status, reason in hostile_reports():
            agent.serve(body, status=http_status)
            start = rejected(ns, "svc", reason)
            wait_for(
                f"{what} to be rejected as {reason}", partial(rejected_twice_since, ns, "svc", reason, start)
            )
            status = world.status("svc")
            assert not status.get("ranks"), (what, status.get("ranks"))
            assert "rank0Headroom" not in status and "bottleneck" not in status, what
            assert not status.get("remediations"), what
            assert world.generation("svc") == generation, what
        assert accepted(ns, "svc") == 0

        # The operator kept running: a good report (one over aiohttp's first read, too) is taken.
        padding = b" " * (200 * 1024)  # JSON allows whitespace; 200 KiB is under the limit
        agent.serve(lambda: valid_report((3 * GiB, 2 * GiB)) + padding)
        status = wait_for("the good report in status", lambda: (s := world.status("svc")).get("ranks") and s)
        assert accepted(ns, "svc") >= 1
        assert status["bottleneck"] == "rank 1" and status["minHeadroom"] == "2Gi"
        assert world.generation("svc") == generation
        assert not world.warning_events("svc")
