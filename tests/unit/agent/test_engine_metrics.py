"""engine_metrics: where the agent reads the engine's /metrics (from the argv the launcher runs),
how it reads the KV usage out of it, and vLLM's names it relies on, checked against the names and
flags recorded from each release (vllm_snapshots/<v>/metrics.json and cli.json)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from rankguard_agent.engine_metrics import (
    DEFAULT_ENGINE_PORT,
    HTTP_FLAGS,
    KV_USAGE_METRIC,
    MISSING,
    UNPARSABLE,
    EngineHttp,
    EngineMetricsError,
    engine_http,
    kv_usage,
)
from rankguard_agent.wire.group import SINGLE_NODE, GroupPlace
from rankguard_operator import vllm_snapshots

# the releases whose metric names are recorded, the ones users run among them
RELEASES = ("0.33.0", "0.34.0")


def recorded(version: str, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((resources.files(vllm_snapshots) / version / name).read_text())
    assert doc["vllm_version"] == version
    return doc


@pytest.mark.parametrize("version", RELEASES)
def test_the_kv_usage_name_is_vllms_own(version: str) -> None:
    metric = recorded(version, "metrics.json")["metrics"].get(KV_USAGE_METRIC)
    assert metric is not None, f"vLLM {version} has no {KV_USAGE_METRIC}"
    assert metric["type"] == "gauge"
    assert KV_USAGE_METRIC in metric["samples"]  # the sample name kv_usage() matches
    assert "engine" in metric["labels"]  # one sample per data parallel engine: their mean is read


@pytest.mark.parametrize("version", RELEASES)
def test_the_http_flags_are_vllm_serves_own(version: str) -> None:
    options = {
        spelling: option
        for option in recorded(version, "cli.json")["options"]
        for spelling in option["option_strings"]
    }
    for flag, dest in HTTP_FLAGS.items():
        assert options[flag]["dest"] == dest, flag
    assert options["--headless"]["kind"] == "true"  # a switch: its presence says it
    assert options["--port"]["default"] == DEFAULT_ENGINE_PORT


LEADER = GroupPlace(nnodes=2, node_rank=0, tp=2, local_world=1)
WORKER = GroupPlace(nnodes=2, node_rank=1, tp=2, local_world=1)
POD_IP = {"POD_IP": "10.1.2.3"}


@pytest.mark.parametrize(
    ("argv", "env", "place", "want"),
    [
        # what the operator renders: a wildcard host, read on the pod's IP
        (["--host", "0.0.0.0", "--port", "8000"], POD_IP, SINGLE_NODE, "http://10.1.2.3:8000/metrics"),
        (["--host", "::", "--port", "8000"], {"POD_IP": "fd00::7"}, LEADER, "http://[fd00::7]:8000/metrics"),
        ([], {}, SINGLE_NODE, "http://127.0.0.1:8000/metrics"),  # vLLM's defaults, no pod IP
        (["--host=::"], {}, SINGLE_NODE, "http://[::1]:8000/metrics"),
        (
            ["--host", "127.0.0.5", "--port=9000", "--port", "9001"],
            POD_IP,
            SINGLE_NODE,
            "http://127.0.0.5:9001/metrics",
        ),
        (["--port", "eighty"], {}, SINGLE_NODE, "http://127.0.0.1:8000/metrics"),
        (
            ["--ssl-certfile", "/tls/crt", "--ssl-keyfile", "/tls/key"],
            {},
            SINGLE_NODE,
            "https://127.0.0.1:8000/metrics",
        ),
    ],
)
def test_where_the_engine_is_read(argv: list[str], env: dict[str, str], place: GroupPlace, want: str) -> None:
    assert engine_http(["vllm", "serve", "m", *argv], env, place) == EngineHttp(want)


def test_a_unix_socket_is_read_through_it() -> None:
    got = engine_http(["vllm", "serve", "m", "--uds", "/run/vllm.sock", "--port", "1"], {}, SINGLE_NODE)
    assert got == EngineHttp("http://localhost/metrics", uds="/run/vllm.sock")


@pytest.mark.parametrize(
    ("argv", "place"),
    [([], WORKER), (["--headless"], WORKER), (["--headless"], SINGLE_NODE), (["--headless"], LEADER)],
)
def test_a_pod_without_the_engines_http_reads_nothing(argv: list[str], place: GroupPlace) -> None:
    assert engine_http(["vllm", "serve", "m", "--port", "8000", *argv], {}, place) is None


def exposition(*usages: float) -> str:
    registry = CollectorRegistry()
    gauge = Gauge(KV_USAGE_METRIC, "usage", ["model_name", "engine"], registry=registry)
    for i, value in enumerate(usages):
        gauge.labels("m", str(i)).set(value)
    return generate_latest(registry).decode()


def test_the_usage_is_the_mean_over_the_engines() -> None:
    assert kv_usage(exposition(0.25)) == 0.25
    assert kv_usage(exposition(0.2, 0.6, 1.0)) == pytest.approx(0.6)
    assert kv_usage(exposition(float("nan"), 0.5)) == 0.5  # a NaN is no figure
    assert kv_usage(exposition(1.5)) == 1.0  # a fraction, whatever the engine says


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (exposition(), MISSING),  # declared, no sample yet
        ("", MISSING),
        (exposition(float("nan")), MISSING),
        (f"{KV_USAGE_METRIC}{{engine=0}} 1\n", UNPARSABLE),  # a label value unquoted
    ],
)
def test_no_usage_is_an_error_with_its_reason(text: str, reason: str) -> None:
    with pytest.raises(EngineMetricsError) as caught:
        kv_usage(text)
    assert caught.value.reason == reason
