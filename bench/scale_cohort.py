"""The "report change" cohort of bench/operator_scale.py: K serving pods made Running and Ready
by the bench itself, and one aiohttp server answering `/report` for all of them.

No GPU node exists, so every serving pod stays Pending (the steady state the bench measures).
For the cohort the bench plays the kubelet: a Node with no GPUs (so the scheduler places no
TP8 pod there by itself) kept alive as a kubelet does (rankguard_sim.kubelet.nodes: Ready condition and
Lease renewals, or the node-lifecycle controller would taint it and evict the pods), each cohort
pod bound to it through the pods/binding subresource and given a kubelet-shaped Running/Ready
status (rankguard_sim.kubelet.pod.status) with its own address 127.0.1.x. The reports are the agent's
own `Report` objects, serialised with its own `to_json`, and checked with the operator's
`parse_report` before anything is served; each pod is told apart by the local address its
request arrived on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

from aiohttp import web
from kubernetes import client

from rankguard_agent import __version__ as AGENT_VERSION
from rankguard_agent.wire.report import REPORT_VERSION, RankSample, Report, parse_report
from rankguard_sim.kubelet.nodes import heartbeat, register_node
from rankguard_sim.kubelet.pod.status import ContainerView, Termination, pod_status, rfc3339
from scale_measure import MIB

NODE = "rankguard-bench-cohort"
HEARTBEAT_SECONDS = 5.0  # well inside the controller-manager's 20 s node-monitor grace period


def cohort_ips(k: int) -> list[str]:
    if not 0 <= k <= 250:
        raise ValueError("the report cohort is at most 250 pods (127.0.1.1-127.0.1.250)")
    return [f"127.0.1.{i + 1}" for i in range(k)]


def free_port_on(ips: list[str], tries: int = 20) -> int:
    """A port free on every one of `ips` (the agent port is one per service, shared by its pods)."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind((ips[0], 0))
            port = int(s.getsockname()[1])
        try:
            for ip in ips[1:]:
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {ips}")


class FakeAgents:
    """GET /report on <ip>:<port> for each cohort IP, each IP one pod with `ranks` GPUs."""

    def __init__(self, ips: list[str], port: int, ranks: int, total_bytes: int, min_free_bytes: int) -> None:
        self.ips, self.port, self.total = ips, port, total_bytes
        self._min_free = {ip: [min_free_bytes] * ranks for ip in ips}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="fake-agents", daemon=True)
        self.served = 0

    def report(self, ip: str) -> bytes:
        with self._lock:
            min_free = list(self._min_free[ip])
        ranks = [
            RankSample(
                rank=r,
                uuid=f"GPU-bench-{ip}-{r}",
                total_bytes=self.total,
                used_bytes=self.total - (m + 512 * MIB),
                free_bytes=m + 512 * MIB,
                min_free_bytes=m,
                window_seconds=10.0,
            )
            for r, m in enumerate(min_free)
        ]
        # as the agent's server builds it (rankguard_agent.server.AgentState.report)
        return Report(
            version=REPORT_VERSION, agent_version=AGENT_VERSION, timestamp=time.time(), ranks=ranks
        ).to_json()

    def set_min_free(self, ip: str, rank: int, value: int) -> float:
        """Serve a new figure from now on; returns the monotonic time it took effect."""
        with self._lock:
            self._min_free[ip][rank] = value
            return time.monotonic()

    async def _handle(self, request: web.Request) -> web.Response:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        ip = str(sock[0]) if sock else ""
        if ip not in self._min_free:
            return web.Response(status=404)
        self.served += 1
        return web.Response(body=self.report(ip), content_type="application/json")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            app = web.Application()
            app.router.add_get("/report", self._handle)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            for ip in self.ips:
                await web.TCPSite(self._runner, ip, self.port).start()

        try:
            self._loop.run_until_complete(start())
        except BaseException as e:  # told to start(), which raises it
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> None:
        parse_report(self.report(self.ips[0]))  # the operator must accept what we serve
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"the fake agents could not listen: {self._error}") from self._error

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def cleanup() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class FakeNode:
    """A Node with no GPUs that the bench keeps Ready, for the cohort's pods to be bound to."""

    def __init__(self, api: Any) -> None:
        self.api = api
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fake-node", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        register_node(self.api, NODE, gpus=0, address="127.0.0.1")
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            try:
                heartbeat(self.api, NODE)
            except Exception as e:  # kept for the report; the next beat tries again
                self.error = e

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(HEARTBEAT_SECONDS + 5)


def run_pod(api: Any, namespace: str, pod: Any, ip: str) -> None:
    """Bind a Pending serving pod to the fake node and write the status a kubelet would once
    every container runs and is ready (init containers completed), with `ip` as its address."""
    core = client.CoreV1Api(api)
    name = pod.metadata.name
    binding = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name},
        "target": {"apiVersion": "v1", "kind": "Node", "name": NODE},
    }
    # _preload_content=False: the client cannot deserialise the Binding it gets back.
    core.create_namespaced_pod_binding(name, namespace, binding, _preload_content=False)
    now = time.time()
    done = Termination(exit_code=0, reason="Completed", started_at=now - 2, finished_at=now - 1)
    init = [
        ContainerView(
            c.name, c.image, state="terminated", terminated=done, container_id=f"bench://{name}-{c.name}"
        )
        for c in pod.spec.init_containers or []
    ]
    containers = [
        ContainerView(
            c.name,
            c.image,
            state="running",
            started_at=now - 1,
            ready=True,
            started=True,
            container_id=f"bench://{name}-{c.name}",
        )
        for c in pod.spec.containers
    ]
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": rfc3339(now)}
    status = pod_status(
        init=init,
        containers=containers,
        restart_policy=pod.spec.restart_policy or "Always",
        pod_ip=ip,
        host_ip="127.0.0.1",
        start_time=now - 2,
        now=now,
        previous_conditions=[scheduled],
    )
    core.patch_namespaced_pod_status(name, namespace, {"status": status})
