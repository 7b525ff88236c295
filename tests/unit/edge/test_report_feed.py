"""The operator's long-polls of its agents (edge/report_feed) against the agent's real app on
127.0.0.1 (readings from simulated GPUs on disk): a pass reads the kept answers, and only news
wakes the service's loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device, write_proc
from rankguard_agent.sampler import Sampler
from rankguard_agent.server import AgentServer, AgentState
from rankguard_operator.edge.metrics import forget_service
from rankguard_operator.edge.report_feed import ReportFeed
from rankguard_operator.edge.scrape import Scraper, Target, close_shared_session

GIB, MIB = 1 << 30, 1 << 20
NAMESPACE, SERVICE = "feed-test", "feed-test"


async def until(what: str, probe: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not probe():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def unreachable() -> float:
    labels = {"namespace": NAMESPACE, "llmservice": SERVICE, "reason": "unreachable"}
    return REGISTRY.get_sample_value("rankguard_operator_reports_rejected_total", labels) or 0.0


class Wakes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[AgentState, Target]]:
    write_device(tmp_path, "GPU-aa", index=0, total_bytes=80 * GIB)
    write_proc(tmp_path, "GPU-aa", "vllm", 60 * GIB)
    state = AgentState(
        sampler=Sampler(SimBackend(tmp_path, {}), hz=10, window_seconds=30), backend_name="sim"
    )
    state.sampler.sample_once()
    server = AgentServer(state, "127.0.0.1", 0)
    port = await server.start()
    try:
        yield state, Target("pod-a", "127.0.0.1", port)
    finally:
        await server.stop()
        await close_shared_session()
        forget_service(NAMESPACE, SERVICE)


def feed(wakes: Wakes, retry: float = 0.2) -> ReportFeed:
    f = ReportFeed(Scraper(SERVICE, NAMESPACE), stale_after=30.0, retry=retry)
    f.wake = wakes
    return f


async def test_a_pass_reads_the_first_answer_and_only_news_wakes_the_loop(
    agent: tuple[AgentState, Target], tmp_path: Path
) -> None:
    state, target = agent
    wakes = Wakes()
    f = feed(wakes)
    try:
        first = await f.read([target])  # a new pod's first answer is waited for
        assert [r.report.ranks[0].free_bytes for r in first.reports] == [20 * GIB] and not first.misses
        assert wakes.count == 0  # the pass that asked is reading it: nobody to wake

        write_proc(tmp_path, "GPU-aa", "vllm", 60 * GIB + 100 * MIB)  # drift: 0.1 % of the GPU
        state.sampler.sample_once()
        write_proc(tmp_path, "GPU-aa", "vllm", 62 * GIB)  # 2.5 %: news
        state.sampler.sample_once()
        await until("a wake-up", lambda: wakes.count >= 1)
        second = await f.read([target])
        assert [r.report.ranks[0].free_bytes for r in second.reports] == [18 * GIB]
    finally:
        await f.close()


async def test_an_agent_gone_is_a_miss_that_wakes_once_and_a_pod_gone_is_forgotten(
    agent: tuple[AgentState, Target],
) -> None:
    _, target = agent
    wakes = Wakes()
    f = feed(wakes)
    try:
        await f.read([target])
        gone = Target("pod-b", "127.0.0.1", 1)  # nothing listens on port 1
        read = await f.read([target, gone])
        assert [m.pod for m in read.misses] == ["pod-b"] and read.misses[0].kind == "unreachable"
        woken, failed = wakes.count, unreachable()
        await until("three more failed polls of pod-b", lambda: unreachable() >= failed + 3)
        assert wakes.count == woken  # the same miss again is not news
        assert [r.pod for r in (await f.read([target])).reports] == ["pod-a"]
        assert f.polled() == ["pod-a"]  # pod-b's poll stopped with it
    finally:
        await f.close()


async def test_an_agent_without_the_long_poll_is_asked_at_intervals() -> None:
    served = 0

    async def report(_: web.Request) -> web.Response:
        nonlocal served
        served += 1
        return web.Response(status=503, body=b'{"agentError": "no GPU backend"}')

    app = web.Application()
    app.router.add_get("/report", report)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = int(runner.addresses[0][1])
    f = feed(Wakes(), retry=0.1)
    try:
        read = await f.read([Target("pod-c", "127.0.0.1", port)])
        assert read.misses[0].agent_error == "no GPU backend"
        await until("a few more asks, at the retry interval", lambda: served >= 4)
    finally:
        await f.close()
        await runner.cleanup()
        await close_shared_session()
        forget_service(NAMESPACE, SERVICE)
