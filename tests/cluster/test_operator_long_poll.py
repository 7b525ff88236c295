"""A Running service's agent, long-polled (issue 31): the real agent package (AgentState and its
aiohttp app, readings from the simulated GPUs on disk) serves the pod's /report; the in-process
operator holds one poll open at a time, a drift within 1 % of the GPU is neither answered nor
written to status, and a drop beyond it reaches status.ranks."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import web
from operator_world import QUIET_PASSES, GiB, MiB, ReportServer, World, operator, service_doc

from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device, write_proc
from rankguard_agent.sampler import Sampler
from rankguard_agent.server import AgentState, build_app
from rankguard_operator.edge.report_feed import MAX_WAIT_SECONDS
from rankguard_sim.kube.cluster import free_port
from rankguard_sim.waiting import wait_for

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RealAgent(ReportServer):
    """The agent's own app on 127.0.0.1:<port> (ReportServer's thread and loop), counting
    answered polls."""

    def __init__(self, state: AgentState, port: int) -> None:
        super().__init__(port)
        self.state = state
        self.polls = 0  # answers to a long-poll that named an earlier answer (`since`)

    @web.middleware
    async def _count(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        if request.path == "/report" and "since" in request.query:
            self.polls += 1
        return response

    async def _start(self) -> None:
        app = build_app(self.state)
        app.middlewares.append(self._count)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()


def min_free(world: World, name: str) -> list[int]:
    return [int(r["minFreeBytes"]) for r in world.status(name).get("ranks") or []]


def test_a_running_services_agent_is_long_polled_and_only_news_reaches_status(
    world: World, tmp_path: Path
) -> None:
    for i, uuid in enumerate(("GPU-aa", "GPU-bb")):
        write_device(tmp_path, uuid, index=i, total_bytes=80 * GiB)
        write_proc(tmp_path, uuid, "vllm", 60 * GiB)  # 20 GiB free on each
    # a one-second window, so the minimum follows a change within a second
    sampler = Sampler(SimBackend(tmp_path, {}), hz=10, window_seconds=1.0)
    sampler.start()
    port = free_port()
    try:
        with RealAgent(AgentState(sampler=sampler, backend_name="sim"), port) as agent, operator(world.ns):
            world.create(service_doc("svc", port))
            world.ready_service("svc")
            world.kubelet_ready(world.new_pod("svc")["metadata"]["name"])
            wait_for("the agent's figures in status", lambda: min_free(world, "svc") == [20 * GiB] * 2)

            # 200 MiB more in use on rank 0: a quarter of a percent of its GPU
            write_proc(tmp_path, "GPU-aa", "vllm", 60 * GiB + 200 * MiB)
            wait_for("the agent to sample it", lambda: sampler.snapshot()[0].min_free_bytes < 20 * GiB)
            polls, started = agent.polls, time.monotonic()
            world.let_the_loop_look("svc", QUIET_PASSES)
            # the poll in flight was held, not answered at every pass (one may end its wait)
            assert agent.polls - polls <= 1 + int((time.monotonic() - started) / MAX_WAIT_SECONDS)
            assert min_free(world, "svc") == [20 * GiB] * 2  # drift: not written

            # 4 GiB more on rank 1: 5 % of its GPU, news at once
            write_proc(tmp_path, "GPU-bb", "vllm", 64 * GiB)
            wait_for("the drop in status", lambda: min_free(world, "svc")[1:] == [16 * GiB])
            assert agent.polls > polls  # it came as the answer to a held poll
    finally:
        sampler.stop()
