"""The engine's own /metrics, read when Prometheus scrapes the agent: the KV usage behind
`rankguard_kv_free_tokens` (issue 52).

The agent's /metrics exports, on the pod that serves vLLM's HTTP only (one node, or node rank 0
of a multi-node group: the other pods run `--headless`, no API server, and a router never sends
them a request), the KV capacity the engine printed and the part of it free now: capacity ×
(1 − `vllm:kv_cache_usage_perc`). The usage is read from the engine at each scrape, never kept:
a figure that cannot be read now is left out and the failure counted, so a router or an
autoscaler never acts on a stale or guessed one.

Where the engine listens comes from the argv the launcher runs, in vLLM's spellings (`--host`,
`--port` default 8000, `--uds`, `--ssl-certfile`, `--headless`; tests check them against the
recorded cli.json). A wildcard `--host` (what the operator renders: 0.0.0.0 or ::) is read on
the pod's IP (`POD_IP`, which the operator sets): the address the kubelet's probes and the
Service reach the engine on, inside the pod's own network namespace; loopback without it.

Standard library, aiohttp and prometheus_client only: this module runs in the vLLM container.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from rankguard_agent.wire.group import GroupPlace, flag_values

# vLLM's name (vllm/v1/metrics/loggers.py); tests/unit/agent/test_engine_metrics.py checks it
# against the names recorded from each release. A fraction, 1 = full, despite "perc".
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"
DEFAULT_ENGINE_PORT = 8000  # `vllm serve --port`'s default (cli.json)
# `vllm serve` options that say where its HTTP server listens (cli.json), by what they set
HTTP_FLAGS: Mapping[str, str] = {
    "--host": "host",
    "--port": "port",
    "--uds": "uds",
    "--ssl-certfile": "ssl_certfile",
    "--headless": "headless",
}
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
# A scrape waits on this read: well under Prometheus' default scrape timeout of 10 s, and a
# local read of a few hundred series takes milliseconds unless the engine is stuck.
READ_TIMEOUT_SECONDS = 1.0
MAX_BODY = 16 << 20  # vLLM's exposition is tens of KiB; a larger body is not one

# Reasons of rankguard_agent_engine_metrics_errors_total, always exported on a serving pod
TIMEOUT = "timeout"
UNREACHABLE = "unreachable"
HTTP_STATUS = "http_status"
UNPARSABLE = "unparsable"
MISSING = "missing_series"
ERROR_REASONS = (TIMEOUT, UNREACHABLE, HTTP_STATUS, UNPARSABLE, MISSING)


class EngineMetricsError(Exception):
    """The engine's usage could not be read now; `reason` is one of ERROR_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class EngineHttp:
    """Where the engine's /metrics is read: `url`, through the Unix socket `uds` when set."""

    url: str
    uds: str | None = None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def engine_http(argv: Sequence[str], env: Mapping[str, str], place: GroupPlace) -> EngineHttp | None:
    """Where the engine the launcher runs serves /metrics; None on a pod that serves no HTTP (a
    node of a group other than rank 0, a `--headless` engine). A port rankguard cannot read
    answers the default, as vLLM would refuse to start with it anyway."""
    if place.node_rank != 0:
        return None
    said: dict[str, str] = {}
    for key, value in flag_values(argv, HTTP_FLAGS):
        said[key] = value  # the last occurrence wins, as in argparse
    if "headless" in said:
        return None
    scheme = "https" if said.get("ssl_certfile") else "http"
    if said.get("uds"):
        return EngineHttp(f"{scheme}://localhost/metrics", uds=said["uds"])
    port = said.get("port", "")
    port = port if port.isascii() and port.isdigit() else str(DEFAULT_ENGINE_PORT)
    host = said.get("host", "")
    if host in WILDCARD_HOSTS:
        host = env.get("POD_IP") or ("::1" if host == "::" else "127.0.0.1")
    return EngineHttp(f"{scheme}://{_url_host(host)}:{port}/metrics")


def kv_usage(exposition: str) -> float:
    """The engine's KV usage (0..1) from its /metrics text: the mean over its engines (data
    parallel ranks each have an `engine` label value), as one figure for the pod's capacity."""
    values = []
    try:
        for family in text_string_to_metric_families(exposition):
            values += [s.value for s in family.samples if s.name == KV_USAGE_METRIC]
    except ValueError as e:
        raise EngineMetricsError(UNPARSABLE, str(e)[:200]) from e
    values = [v for v in values if math.isfinite(v)]
    if not values:
        raise EngineMetricsError(MISSING, f"no {KV_USAGE_METRIC} sample")
    return min(max(sum(values) / len(values), 0.0), 1.0)


async def read_kv_usage(where: EngineHttp, timeout: float = READ_TIMEOUT_SECONDS) -> float:
    """The engine's KV usage now, read over HTTP; raises EngineMetricsError."""
    # The engine's own certificate names the pod's Service, not the address read here: a local
    # read checks no certificate.
    connector: aiohttp.BaseConnector = (
        aiohttp.UnixConnector(path=where.uds) if where.uds else aiohttp.TCPConnector(ssl=False)
    )
    try:
        async with (
            aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as session,
            session.get(where.url) as response,
        ):
            if response.status != 200:
                raise EngineMetricsError(HTTP_STATUS, f"{where.url} answered {response.status}")
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):  # to its end, not one read
                body += chunk
                if len(body) > MAX_BODY:
                    raise EngineMetricsError(UNPARSABLE, f"{where.url} answered over {MAX_BODY} bytes")
    except TimeoutError as e:
        raise EngineMetricsError(TIMEOUT, f"{where.url} took over {timeout:g} s") from e
    except (aiohttp.ClientError, OSError) as e:
        raise EngineMetricsError(UNREACHABLE, f"{where.url}: {e}") from e
    return kv_usage(body.decode("utf-8", errors="replace"))


def capacity_series(
    capacity: int | None,
    usage: float | None,
    errors_by_reason: Mapping[str, int],
    label_names: list[str],
    label_values: list[str],
) -> Iterator[Metric]:
    """The agent's capacity series (server.AgentCollector yields them on the pod that serves the
    engine's HTTP only). No `pod` label of their own: the scrape's target labels add namespace
    and pod, which join them `on(namespace, pod)` with vllm:*. `usage`: read for this scrape."""
    errors = CounterMetricFamily(
        "rankguard_agent_engine_metrics_errors",
        "Scrapes whose read of the engine's own /metrics failed (rankguard_kv_free_tokens left "
        "out), by reason.",
        labels=["reason", *label_names],
    )
    for reason in sorted(set(ERROR_REASONS) | set(errors_by_reason)):
        errors.add_metric([reason, *label_values], errors_by_reason.get(reason, 0))
    yield errors
    if capacity is None:
        return  # the engine has not printed its KV cache size yet
    tokens = GaugeMetricFamily(
        "rankguard_kv_capacity_tokens",
        "Tokens of KV cache the engine allocated, as it printed them (KV cache size: N tokens).",
        labels=label_names,
    )
    tokens.add_metric(label_values, capacity)
    yield tokens
    if usage is not None:
        free = GaugeMetricFamily(
            "rankguard_kv_free_tokens",
            f"Tokens of KV cache free now: capacity x (1 - the engine's {KV_USAGE_METRIC}, read at "
            "this scrape); absent when that read failed.",
            labels=label_names,
        )
        free.add_metric(label_values, capacity * (1.0 - usage))
        yield free
