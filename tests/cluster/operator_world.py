"""The harness of the in-process operator tests (test_operator.py, test_operator_remediation.py,
test_operator_surroundings.py).

The real operator runs in the test's process under kopf's KopfRunner, watching only a namespace
of its own (`op-…`), so it never meets the e2e suite's operator subprocess (which watches
`e2e-*`). There is no node: `World` plays the kubelet, writing pod status through the
pods/status subresource exactly as a kubelet would (container statuses with
`lastState.terminated`, restart counts, Ready conditions, pod IPs), and `ReportServer` plays the
agent with an aiohttp server on 127.0.0.1 where a pod's `/report` would be. The fixtures that
hand a test its `World` are in conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from aiohttp import web
from kopf.testing import KopfRunner
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client import REGISTRY

from rankguard_agent.wire import termination as tm
from rankguard_agent.wire.report import RankSample, Report
from rankguard_operator.core.names import VLLM_CONTAINER
from rankguard_operator.core.units import iso
from rankguard_sim.waiting import wait_for
from tests.builders import llmservice

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
# Time, and the operator in this process


def now_iso() -> str:
    return iso(time.time())


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
    doc: dict[str, Any] = llmservice(
        name,
        {
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
    )
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
