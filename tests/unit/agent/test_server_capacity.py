"""The agent's capacity series of issue 52 (`rankguard_kv_capacity_tokens`,
`rankguard_kv_free_tokens`): on the pod that serves the engine's HTTP only, the free tokens from
the engine's own /metrics read at each scrape. A real agent server and a real aiohttp server
playing the engine's /metrics, both on 127.0.0.1, read by a real client."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rankguard_agent.engine_metrics import KV_USAGE_METRIC, MISSING, UNREACHABLE, engine_http
from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device
from rankguard_agent.sampler import Sampler
from rankguard_agent.server import AgentServer, AgentState, const_labels_from_env
from rankguard_agent.wire.group import SINGLE_NODE, GroupPlace
from rankguard_agent.wire.recognisers import KV_TOKENS

GIB = 1 << 30
CAPACITY = 123_456
LABELS = {"llmservice": "llama", "namespace": "ml"}
# TP4 x PP2 over two pods of 4 GPUs: node rank 0 serves HTTP, node rank 1 runs --headless
LEADER = GroupPlace(nnodes=2, node_rank=0, tp=4, pp=2, local_world=4)
WORKER = GroupPlace(nnodes=2, node_rank=1, tp=4, pp=2, local_world=4)


@dataclass
class Engine:
    """The engine's /metrics: vLLM's usage gauge per `engine` (data parallel rank), each set to
    `usage[i]`; `serve_usage` False leaves the series out (an engine that has not made it yet)."""

    usage: list[float] = field(default_factory=lambda: [0.25])
    serve_usage: bool = True
    padding: int = 0  # other series before the usage's, as many as a real engine serves
    port: int = 0

    def exposition(self) -> bytes:
        registry = CollectorRegistry()
        other = Gauge("another_series", "another", ["model_name", "engine"], registry=registry)
        other.labels("m", "0").set(3)
        for i in range(self.padding):
            other.labels(f"model-{i:06d}", "0").set(i)
        if self.serve_usage:
            gauge = Gauge(KV_USAGE_METRIC, "usage", ["model_name", "engine"], registry=registry)
            for i, value in enumerate(self.usage):
                gauge.labels("m", str(i)).set(value)
        return generate_latest(registry)


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    fake = Engine()

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=fake.exposition(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = int(runner.addresses[0][1])
    try:
        yield fake
    finally:
        await runner.cleanup()


def argv(port: int, *extra: str) -> list[str]:
    return ["vllm", "serve", "m", "--host", "127.0.0.1", "--port", str(port), *extra]


async def agent_metrics(
    tmp_path: Path,
    place: GroupPlace,
    command: list[str],
    *,
    capacity: int | None = CAPACITY,
    scrapes: int = 1,
    before_each: Callable[[int], None] = lambda _: None,
) -> list[dict[str, list[tuple[dict[str, str], float]]]]:
    """The agent's /metrics, scraped `scrapes` times (`before_each(i)` before the i-th), with the
    engine's address wired as the launcher wires it (`engine_http` from the engine's argv and
    the pod's place)."""
    write_device(tmp_path, "GPU-aa", index=0, total_bytes=80 * GIB)
    sampler = Sampler(SimBackend(tmp_path, {}), hz=10, window_seconds=30)
    sampler.sample_once()
    state = AgentState(
        sampler=sampler,
        backend_name="sim",
        const_labels=const_labels_from_env({"RANKGUARD_LLMSERVICE": "llama", "POD_NAMESPACE": "ml"}),
        place=place,
        engine_http=engine_http(command, {}, place),
    )
    if capacity is not None:
        state.record_kv(KV_TOKENS, f"GPU KV cache size: {capacity:,} tokens", float(capacity))
    server = AgentServer(state, "127.0.0.1", 0)
    port = await server.start()
    out = []
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(scrapes):
                before_each(i)
                async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                    assert r.status == 200
                    out.append(samples(await r.text()))
    finally:
        await server.stop()
    return out


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((dict(s.labels), s.value))
    return found


def errors(seen: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    return {labels["reason"]: value for labels, value in seen["rankguard_agent_engine_metrics_errors_total"]}


@pytest.mark.parametrize("place", [SINGLE_NODE, LEADER], ids=["single-node", "group-leader"])
async def test_the_serving_pod_exports_capacity_and_free_tokens(
    tmp_path: Path, engine: Engine, place: GroupPlace
) -> None:
    (seen,) = await agent_metrics(tmp_path, place, argv(engine.port))
    # the agent's own labels only: the scrape's target labels add namespace and pod
    assert seen["rankguard_kv_capacity_tokens"] == [(LABELS, CAPACITY)]
    assert seen["rankguard_kv_free_tokens"] == [(LABELS, CAPACITY * 0.75)]
    assert set(errors(seen).values()) == {0}


async def test_a_group_worker_exports_neither(tmp_path: Path, engine: Engine) -> None:
    (seen,) = await agent_metrics(tmp_path, WORKER, argv(engine.port, "--headless"))
    names = set(seen)
    assert "rankguard_kv_capacity_tokens" not in names and "rankguard_kv_free_tokens" not in names
    assert "rankguard_agent_engine_metrics_errors_total" not in names  # it reads nothing
    assert "rankguard_gpu_total_bytes" in names  # its own GPUs still are


async def test_a_headless_engine_on_one_node_serves_no_http(tmp_path: Path, engine: Engine) -> None:
    # data parallelism across nodes: read_group answers a single node, the argv says headless
    (seen,) = await agent_metrics(tmp_path, SINGLE_NODE, argv(engine.port, "--headless"))
    assert "rankguard_kv_capacity_tokens" not in seen


async def test_the_free_tokens_follow_the_engines_usage_at_each_scrape(
    tmp_path: Path, engine: Engine
) -> None:
    usages = [[0.5, 0.7], [1.0, 1.0], [0.0]]  # two data parallel engines: their mean

    def load(i: int) -> None:
        engine.usage = usages[i]

    seen = await agent_metrics(tmp_path, SINGLE_NODE, argv(engine.port), scrapes=3, before_each=load)
    free = [value for one in seen for labels, value in one["rankguard_kv_free_tokens"]]
    assert free == [pytest.approx(CAPACITY * 0.4), 0.0, CAPACITY]


async def test_free_tokens_are_left_out_and_counted_when_the_engine_is_down(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    seen = await agent_metrics(tmp_path, SINGLE_NODE, argv(closed), scrapes=2)
    for n, one in enumerate(seen, 1):
        assert one["rankguard_kv_capacity_tokens"] == [(LABELS, CAPACITY)]
        assert "rankguard_kv_free_tokens" not in one
        assert errors(one)[UNREACHABLE] == n and errors(one)[MISSING] == 0


async def test_free_tokens_are_left_out_and_counted_when_the_series_is_missing(
    tmp_path: Path, engine: Engine
) -> None:
    engine.serve_usage = False
    (seen,) = await agent_metrics(tmp_path, SINGLE_NODE, argv(engine.port))
    assert "rankguard_kv_free_tokens" not in seen
    assert errors(seen)[MISSING] == 1 and errors(seen)[UNREACHABLE] == 0


async def test_nothing_before_the_engine_printed_its_kv_cache_size(tmp_path: Path, engine: Engine) -> None:
    (seen,) = await agent_metrics(tmp_path, SINGLE_NODE, argv(engine.port), capacity=None)
    assert "rankguard_kv_capacity_tokens" not in seen and "rankguard_kv_free_tokens" not in seen
    assert set(errors(seen).values()) == {0}  # no read: there is nothing to apply a usage to


async def test_a_large_exposition_is_read_to_its_end(tmp_path: Path, engine: Engine) -> None:
    # a real engine's /metrics (histograms by label) spans many reads; the usage may come last
    engine.padding, engine.usage = 4_000, [0.5]
    assert len(engine.exposition()) > 3 << 16  # three reads of 64 KiB at least
    (seen,) = await agent_metrics(tmp_path, SINGLE_NODE, argv(engine.port))
    assert seen["rankguard_kv_free_tokens"] == [(LABELS, CAPACITY * 0.5)]
