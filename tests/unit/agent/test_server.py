"""The HTTP API on a real aiohttp server (127.0.0.1, any port) with a real aiohttp client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rankguard_agent.gpu import NoGpuBackend
from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device, write_proc
from rankguard_agent.runtime import AgentRuntime, RuntimeConfig
from rankguard_agent.sampler import Sampler
from rankguard_agent.server import AgentServer, AgentState, const_labels_from_env
from rankguard_agent.wire.change import REPORT_TOKEN_HEADER
from rankguard_agent.wire.report import ProbeRank, ProbeResult, parse_report
from rankguard_sim.waiting import wait_for

GIB = 1 << 30


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_device(tmp_path, "GPU-aa", index=0, total_bytes=80 * GIB, reserved_bytes=GIB)
    write_device(tmp_path, "GPU-bb", index=1, total_bytes=80 * GIB)
    write_proc(tmp_path, "GPU-aa", "vllm", 40 * GIB)
    return tmp_path


def make_state(backend: SimBackend | NoGpuBackend, labels: dict[str, str] | None = None) -> AgentState:
    sampler = Sampler(backend, hz=10, window_seconds=30)
    sampler.sample_once()
    return AgentState(sampler=sampler, backend_name=backend.name, const_labels=labels or {})


@pytest.fixture
async def served(root: Path) -> AsyncIterator[tuple[AgentState, str]]:
    state = make_state(
        SimBackend(root, {}), const_labels_from_env({"RANKGUARD_LLMSERVICE": "llama", "POD_NAMESPACE": "ml"})
    )
    server = AgentServer(state, "127.0.0.1", 0)
    port = await server.start()
    try:
        yield state, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


async def get(url: str) -> tuple[int, bytes, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.read(), r.headers.get("Content-Type", "")


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


async def test_report_is_a_valid_contract_document(served: tuple[AgentState, str]) -> None:
    state, base = served
    state.probe = ProbeResult(
        ok=True,
        backend="gloo",
        world_size=2,
        ranks=[ProbeRank(0, 80 * GIB, 79 * GIB, GIB)],
        duration_seconds=1.5,
    )
    state.record_kv("kv_cache_tokens", "GPU KV cache size: 1,000 tokens", 1000.0, timestamp=10.0)
    state.record_kv("available_kv_memory", "Available KV cache memory: 2.00 GiB", 2.0 * GIB, timestamp=11.0)
    status, body, ctype = await get(base + "/report")
    assert status == 200 and ctype.startswith("application/json")
    report = parse_report(body)
    assert [r.uuid for r in report.ranks] == ["GPU-aa", "GPU-bb"]
    r0 = report.ranks[0]
    assert (r0.total_bytes, r0.used_bytes, r0.free_bytes, r0.min_free_bytes) == (
        80 * GIB,
        41 * GIB,
        39 * GIB,
        39 * GIB,
    )
    assert r0.window_seconds == 30 and r0.error is None
    assert report.probe is not None and report.probe.ranks[0].comm_bytes == GIB
    assert [k.kind for k in report.kv_lines] == ["kv_cache_tokens", "available_kv_memory"]
    last = state.last_kv_line()
    assert last is not None and last.kind == "available_kv_memory"
    assert report.agent_version and report.timestamp > 0


async def test_metrics_parse_and_match_the_report(served: tuple[AgentState, str]) -> None:
    _, base = served
    status, body, ctype = await get(base + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    fams = families(body.decode())
    free = {s[0]["rank"]: s for s in fams["rankguard_gpu_free_bytes"]}
    assert free["0"][1] == 39 * GIB and free["1"][1] == 80 * GIB
    assert free["0"][0] == {"rank": "0", "gpu_uuid": "GPU-aa", "llmservice": "llama", "namespace": "ml"}
    assert {s[1] for s in fams["rankguard_gpu_total_bytes"]} == {80 * GIB}
    assert [s[1] for s in fams["rankguard_gpu_min_free_bytes"] if s[0]["rank"] == "0"] == [39 * GIB]
    assert [s[1] for s in fams["rankguard_gpu_used_bytes"] if s[0]["rank"] == "0"] == [41 * GIB]
    assert [s[1] for s in fams["rankguard_gpu_reserved_bytes"] if s[0]["rank"] == "0"] == [GIB]
    assert fams["rankguard_agent_samples_total"][0][1] == 2
    assert fams["rankguard_agent_sampler_errors_total"][0][1] == 0
    assert fams["rankguard_agent_info"][0][0]["backend"] == "sim"
    assert "rankguard_probe_ok" not in fams  # no probe ran


async def test_a_lost_gpu_still_gives_a_valid_report_and_metrics(root: Path) -> None:
    state = make_state(SimBackend(root, {}))
    write_device(root, "GPU-bb", index=1, total_bytes=80 * GIB, lost=True)
    state.sampler.sample_once()
    server = AgentServer(state, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{await server.start()}"
    try:
        report = parse_report((await get(base + "/report"))[1])
        assert report.ranks[1].error == "GpuIsLost" and report.ranks[0].error is None
        fams = families((await get(base + "/metrics"))[1].decode())
        up = {s[0]["rank"]: s[1] for s in fams["rankguard_gpu_up"]}
        assert up == {"0": 1.0, "1": 0.0}
        assert fams["rankguard_agent_sampler_errors_total"][0][1] == 1
    finally:
        await server.stop()


async def test_healthz(served: tuple[AgentState, str]) -> None:
    _, base = served
    status, body, _ = await get(base + "/healthz")
    assert status == 200 and b'"status": "ok"' in body


async def test_listening_on_ipv6_any_also_answers_ipv4(root: Path) -> None:
    """spec.listenAddress "::" on a dual-stack cluster: the operator may reach the pod by IPv4."""
    server = AgentServer(make_state(SimBackend(root, {})), "::", 0)
    port = await server.start()
    try:
        for base in (f"http://127.0.0.1:{port}", f"http://[::1]:{port}"):
            status, _, _ = await get(base + "/healthz")
            assert status == 200, base
    finally:
        await server.stop()


async def test_no_gpu_agent_serves_an_empty_report_with_sampler_not_ok() -> None:
    runtime = AgentRuntime(RuntimeConfig(host="127.0.0.1", port=0), {}, backend=NoGpuBackend("no NVML"))
    runtime.state.backend_error = "no NVML"
    await runtime.start()
    try:
        assert runtime.serving and runtime.server.port
        base = f"http://127.0.0.1:{runtime.server.port}"
        report = parse_report((await get(base + "/report"))[1])
        assert report.ranks == [] and report.sampler_ok is False
        fams = families((await get(base + "/metrics"))[1].decode())
        assert fams["rankguard_agent_sampler_up"][0][1] == 0
        assert b"no NVML" in (await get(base + "/healthz"))[1]
    finally:
        await runtime.stop()


async def test_a_taken_port_leaves_the_agent_running_without_its_api(root: Path) -> None:
    first = AgentRuntime(
        RuntimeConfig(backend="sim", host="127.0.0.1", port=0), {"RANKGUARD_SIM_GPU_ROOT": str(root)}
    )
    await first.start()
    second = AgentRuntime(
        RuntimeConfig(backend="sim", host="127.0.0.1", port=first.server.port or 0),
        {"RANKGUARD_SIM_GPU_ROOT": str(root)},
    )
    try:
        await second.start()
        assert first.serving and not second.serving

        def ticking() -> bool:  # the sampler runs on regardless
            return second.sampler.ticks_total >= 2 and second.sampler.is_up()

        # waited for, not given a fixed time: a loaded machine may start its thread late
        await asyncio.to_thread(wait_for, "the second agent's sampler to tick", ticking, 30, 0.02)
    finally:
        await second.stop()
        await first.stop()


def test_labels_only_when_set() -> None:
    assert const_labels_from_env({}) == {}
    assert const_labels_from_env({"POD_NAMESPACE": "ml"}) == {"namespace": "ml"}


async def poll(base: str, **params: str) -> tuple[int, bytes, str | None]:
    async with aiohttp.ClientSession() as s, s.get(base + "/report", params=params) as r:
        return r.status, await r.read(), r.headers.get(REPORT_TOKEN_HEADER)


async def test_a_long_poll_answers_at_once_for_an_unknown_since_and_holds_while_nothing_is_news(
    served: tuple[AgentState, str],
) -> None:
    _, base = served
    status, body, token = await poll(base, wait="30")  # no since: a first poll
    assert status == 200 and token
    status, _, other = await poll(base, wait="30", since="a-token-from-a-restarted-agent")
    assert status == 200 and other and other != token
    started = time.monotonic()
    status, again, later = await poll(base, wait="1", since=token)
    assert status == 200 and time.monotonic() - started >= 1.0  # held the whole wait
    assert later not in (None, token, other)
    assert [r.min_free_bytes for r in parse_report(again).ranks] == [
        r.min_free_bytes for r in parse_report(body).ranks
    ]


async def test_a_held_poll_is_answered_when_a_rank_moves_by_a_percent_of_its_gpu(
    served: tuple[AgentState, str], root: Path
) -> None:
    state, base = served
    _, body, token = await poll(base, wait="30")
    assert token is not None
    before = parse_report(body).ranks[1].free_bytes
    held = asyncio.ensure_future(poll(base, wait="60", since=token))
    write_proc(root, "GPU-bb", "vllm", 2 * GIB)  # 2.5 % of the 80 GiB GPU
    state.sampler.sample_once()
    status, answer, _ = await asyncio.wait_for(held, 30)
    assert status == 200 and parse_report(answer).ranks[1].free_bytes == before - 2 * GIB


async def test_a_held_poll_is_answered_when_a_kv_line_arrives(served: tuple[AgentState, str]) -> None:
    state, base = served
    _, _, token = await poll(base, wait="30")
    assert token is not None
    held = asyncio.ensure_future(poll(base, wait="60", since=token))
    state.record_kv("kv_cache_tokens", "GPU KV cache size: 1,000 tokens", 1000.0)
    status, answer, _ = await asyncio.wait_for(held, 30)
    assert status == 200 and [k.kind for k in parse_report(answer).kv_lines] == ["kv_cache_tokens"]


@pytest.mark.parametrize("query", ["wait=soon", "wait=5&lines=many", "wait=5&lines=-1"])
async def test_a_malformed_poll_is_refused_with_its_usage(served: tuple[AgentState, str], query: str) -> None:
    _, base = served
    status, body, _ = await get(f"{base}/report?{query}")
    assert status == 400 and b"/report?wait=<seconds>" in body
