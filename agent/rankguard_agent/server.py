"""The agent's HTTP API (aiohttp): GET /healthz, GET /report, GET /metrics.

/report is `report.Report` as JSON (the contract the operator parses). With `?wait=` it is a
long-poll (wire/change: held until the report is news for that poller, or `wait` seconds): the
operator holds one per pod instead of scraping every pod every 2 s (issue 31). /metrics is built
by prometheus_client from a collector over the same snapshot, on its own registry, so the
exposition always matches the report and no global state is touched. On the pod that serves the
engine's HTTP it also carries the KV capacity series of issue 52, the free tokens from the
engine's own /metrics read during the scrape (engine_metrics.py).

The sampler counts the pod's GPUs 0..N-1; both endpoints name a rank by vLLM's GLOBAL rank
(`AgentState.place`: the same numbers on one node). On a pod of a multi-node group a GPU beyond
the ranks vLLM runs on each pod is no rank of the group and is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import socket
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankguard_agent import __version__
from rankguard_agent.engine_metrics import EngineHttp, EngineMetricsError, capacity_series, read_kv_usage
from rankguard_agent.sampler import Sampler
from rankguard_agent.wire.change import MAX_WAIT_SECONDS, REPORT_TOKEN_HEADER, news, parse_lines
from rankguard_agent.wire.group import SINGLE_NODE, GroupPlace
from rankguard_agent.wire.recognisers import KV_TOKENS
from rankguard_agent.wire.report import (
    MAX_TEXT,
    REPORT_VERSION,
    EngineMemory,
    KVLine,
    ProbeResult,
    RankSample,
    Report,
)
from rankguard_agent.wire.report_memory import WarmupMemory
from rankguard_agent.wire.report_model import ModelReport

log = logging.getLogger("rankguard_agent.server")

CONTENT_TYPE_LATEST = "text/plain; version=0.0.4; charset=utf-8"
# Kinds of rankguard_agent_unparsed_lines_total always exported (at 0 too), so that a rate()
# or an alert on them works before the first one: the per-worker reports rankguard reads, and
# "worker_prefix" for a per-worker line whose rank cannot be told; and vLLM 0.34's extensible KV
# cache lines.
UNPARSED_KINDS = (
    "worker_memory_report",
    "cuda_graph_pool",
    "initial_free_memory",
    "worker_prefix",
    "memory_after_warmup",
    "extensible_kv_disabled",
)
# A held long-poll looks at the report this often: ten samples of the sampler's 10 a second (a
# rank's window minimum already holds any dip between two looks), and a fifth of the 5 s the
# operator is allowed from a change to its status. Each look builds the report: in a pod that
# is nothing, in a bench serving a thousand agents from one process it is most of their CPU.
POLL_CHECK_SECONDS = 1.0
# Answers remembered by token, so two pollers (a new leader while the old one still polls, a
# person's curl) each get news against what they were last told, not each other's answers.
ANSWERS_KEPT = 8


@dataclass
class AgentState:
    """Everything the endpoints show. Written by the launcher, read by the handlers."""

    sampler: Sampler
    backend_name: str
    const_labels: dict[str, str] = field(default_factory=dict)
    probe: ProbeResult | None = None
    kv_lines: dict[str, KVLine] = field(default_factory=dict)  # the last line of each kind
    backend_error: str | None = None  # why there are no readings at all, if so
    engine_version: str | None = None  # the vLLM the launcher started, from its package metadata
    engine_memory: dict[int, EngineMemory] = field(default_factory=dict)  # by local rank (GPU index)
    unparsed_lines: dict[str, int] = field(default_factory=dict)  # by kind; see UNPARSED_KINDS
    model: ModelReport | None = None  # the served model's files (model_watch), once read
    place: GroupPlace = SINGLE_NODE  # the pod's place in a vLLM multi-node group (launch only)
    # vLLM 0.34's extensible KV cache: each rank's "Memory after warmup" line (by local rank), the
    # reason the engine gave for turning the mode off, and what the driver offers it (runtime)
    warmup: dict[int, WarmupMemory] = field(default_factory=dict)
    extensible_disabled: str | None = None
    vmm: bool | None = None
    imex_channel: bool | None = None
    # where the engine serves /metrics, on the pod that serves its HTTP only (engine_metrics.py;
    # None on a group's other pods and under `serve`): the capacity series are exported there
    engine_http: EngineHttp | None = None
    engine_metrics_errors: dict[str, int] = field(default_factory=dict)  # by reason
    # long-poll answers by token, newest last; the prefix tells this process's from a restarted one's
    _answered: OrderedDict[str, Report] = field(default_factory=OrderedDict, init=False, repr=False)
    _tokens: Iterator[str] = field(
        default_factory=lambda: (f"{secrets.token_hex(4)}-{n}" for n in itertools.count(1)),
        init=False,
        repr=False,
    )

    def answered(self, token: str | None) -> Report | None:
        """The report last answered as `token`, if this process still remembers it."""
        return self._answered.get(token) if token else None

    def remember(self, report: Report) -> str:
        """Name an answer for the poller's next `since`."""
        token = next(self._tokens)
        self._answered[token] = report
        while len(self._answered) > ANSWERS_KEPT:
            self._answered.popitem(last=False)
        return token

    def record_engine_memory(self, local_rank: int, seen: EngineMemory) -> None:
        """Merge what a worker line said into the account of the pod's GPU `local_rank`: the
        figures it carries replace the older ones, the others stay (the CUDA graph line carries
        one figure)."""
        old = self.engine_memory.get(local_rank)
        if old is not None:
            said = {k: v for k, v in dataclasses.asdict(seen).items() if v is not None}
            seen = dataclasses.replace(old, **said)
        self.engine_memory[local_rank] = seen

    def global_rank(self, local_rank: int) -> int | None:
        """The rank /report and /metrics give the pod's GPU `local_rank`; None for a GPU that is
        no rank of the group (beyond the ranks vLLM runs on each pod)."""
        place = self.place
        if place.multi_node and local_rank >= place.local_world:
            return None
        return place.global_rank(local_rank)

    def _ranked(self, sample: RankSample) -> RankSample | None:
        local = sample.rank
        rank = self.global_rank(local)
        if rank is None:
            return None
        memory = self.engine_memory.get(local)
        warmup = self.warmup.get(local)
        if not self.place.multi_node:
            if memory is None and warmup is None:
                return sample
            return dataclasses.replace(sample, engine_memory=memory, warmup=warmup)
        return dataclasses.replace(
            sample,
            rank=rank,
            engine_memory=memory,
            warmup=warmup,
            local_rank=local,
            stage=self.place.stage(rank),
            tp_rank=self.place.tp_rank(rank),
        )

    def count_unparsed(self, kind: str) -> None:
        self.unparsed_lines[kind] = self.unparsed_lines.get(kind, 0) + 1

    def record_kv(self, kind: str, text: str, value: float, timestamp: float | None = None) -> None:
        self.kv_lines[kind] = KVLine(
            kind, text[:MAX_TEXT], value, time.time() if timestamp is None else timestamp
        )

    def last_kv_line(self) -> KVLine | None:
        return max(self.kv_lines.values(), key=lambda k: k.timestamp, default=None)

    def kv_capacity_tokens(self) -> int | None:
        """The engine's own "KV cache size: N tokens" on the pod that serves its HTTP; None
        elsewhere and until the engine printed it."""
        line = self.kv_lines.get(KV_TOKENS)
        return None if self.engine_http is None or line is None else round(line.value)

    async def read_kv_usage(self) -> float | None:
        """The engine's KV usage now (0..1), when the capacity it applies to is known; a read
        that fails is counted by reason and answers None (the free figure is then left out)."""
        if self.engine_http is None or self.kv_capacity_tokens() is None:
            return None
        try:
            return await read_kv_usage(self.engine_http)
        except EngineMetricsError as e:
            self.engine_metrics_errors[e.reason] = self.engine_metrics_errors.get(e.reason, 0) + 1
            log.debug("the engine's KV usage is not readable now: %s", e)
            return None

    def report(self) -> Report:
        ranks = [r for r in map(self._ranked, self.sampler.snapshot()) if r is not None]
        place = self.place
        group = place.multi_node
        return Report(
            version=REPORT_VERSION,
            agent_version=__version__,
            timestamp=time.time(),
            ranks=ranks,
            probe=self.probe,
            kv_lines=sorted(self.kv_lines.values(), key=lambda k: k.timestamp),
            sampler_ok=self.backend_error is None and self.sampler.is_up(),
            engine_version=self.engine_version,
            unparsed_lines={k: n for k, n in self.unparsed_lines.items() if n},
            model=self.model,
            nnodes=place.nnodes if group else None,
            node_rank=place.node_rank if group else None,
            local_world_size=place.local_world if group else None,
            tp_size=place.tp if group else None,
            pp_size=place.pp if group else None,
            vmm=self.vmm,
            imex_channel=self.imex_channel,
            extensible_disabled=self.extensible_disabled,
        )


def const_labels_from_env(env: Mapping[str, str]) -> dict[str, str]:
    """The operator sets these on the pod; they let one Prometheus tell services apart."""
    labels = {}
    if env.get("RANKGUARD_LLMSERVICE"):
        labels["llmservice"] = env["RANKGUARD_LLMSERVICE"]
    if env.get("POD_NAMESPACE"):
        labels["namespace"] = env["POD_NAMESPACE"]
    return labels


class AgentCollector(Collector):
    def __init__(self, state: AgentState, kv_usage: float | None = None) -> None:
        """`kv_usage`: the engine's KV usage read for this scrape (None: not read, or failed)."""
        self.state = state
        self.kv_usage = kv_usage

    def collect(self) -> Iterator[Metric]:
        st = self.state
        extra_names = list(st.const_labels)
        extra_values = [st.const_labels[k] for k in extra_names]
        gpu_labels = ["rank", "gpu_uuid", *extra_names]

        def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=gpu_labels if labels is None else labels)

        total = gauge("rankguard_gpu_total_bytes", "GPU memory capacity of the rank's device.")
        used = gauge(
            "rankguard_gpu_used_bytes", "GPU memory in use (all processes, driver reserve included)."
        )
        free = gauge("rankguard_gpu_free_bytes", "GPU memory free now.")
        min_free = gauge("rankguard_gpu_min_free_bytes", "Minimum free GPU memory over the sampler's window.")
        reserved = gauge("rankguard_gpu_reserved_bytes", "GPU memory the driver reserves (NVML v2).")
        up = gauge("rankguard_gpu_up", "1 if the last reading of the rank's GPU succeeded.")
        others = gauge(
            "rankguard_gpu_others_bytes",
            "GPU memory held by processes that are not this pod's (absent while unknown).",
        )
        others_peak = gauge(
            "rankguard_gpu_others_peak_bytes", "The most rankguard_gpu_others_bytes has been since start."
        )
        readings = st.sampler.readings()
        for sample in st.sampler.snapshot():
            rank = st.global_rank(sample.rank)
            if rank is None:
                continue
            lv = [str(rank), sample.uuid, *extra_values]
            total.add_metric(lv, sample.total_bytes)
            used.add_metric(lv, sample.used_bytes)
            free.add_metric(lv, sample.free_bytes)
            min_free.add_metric(lv, sample.min_free_bytes)
            last = readings[sample.rank] if sample.rank < len(readings) else None
            reserved.add_metric(lv, last.reserved_bytes if last is not None and last.error is None else 0)
            up.add_metric(lv, 0 if sample.error else 1)
            if sample.others_bytes is not None:
                others.add_metric(lv, sample.others_bytes)
            if sample.others_peak_bytes is not None:
                others_peak.add_metric(lv, sample.others_peak_bytes)
        yield from (total, used, free, min_free, reserved, up, others, others_peak)

        s = st.sampler
        sampler_up = gauge(
            "rankguard_agent_sampler_up", "1 if the sampler is running and current.", extra_names
        )
        sampler_up.add_metric(extra_values, 1 if st.backend_error is None and s.is_up() else 0)
        samples = CounterMetricFamily(
            "rankguard_agent_samples", "Successful per-rank readings.", labels=extra_names
        )
        samples.add_metric(extra_values, s.samples_total)
        errors = CounterMetricFamily(
            "rankguard_agent_sampler_errors", "Failed per-rank readings.", labels=extra_names
        )
        errors.add_metric(extra_values, s.errors_total)
        age = gauge(
            "rankguard_agent_sampler_last_sample_age_seconds", "Seconds since the last tick.", extra_names
        )
        age.add_metric(extra_values, s.last_sample_age() or 0.0)
        info = gauge(
            "rankguard_agent_info",
            "The agent's version and GPU backend.",
            ["version", "backend", *extra_names],
        )
        info.add_metric([__version__, st.backend_name, *extra_values], 1)
        unparsed = CounterMetricFamily(
            "rankguard_agent_unparsed_lines",
            "Engine lines that carried the marker of a per-worker report but could not be read "
            "(cut, garbled, an unknown format) or attributed to a rank; never acted upon.",
            labels=["kind", *extra_names],
        )
        for kind in sorted(set(UNPARSED_KINDS) | set(st.unparsed_lines)):
            unparsed.add_metric([kind, *extra_values], st.unparsed_lines.get(kind, 0))
        yield from (sampler_up, samples, errors, age, info, unparsed)
        if st.engine_http is not None:  # the pod that serves the engine's HTTP
            capacity, errors_by_reason = st.kv_capacity_tokens(), st.engine_metrics_errors
            yield from capacity_series(capacity, self.kv_usage, errors_by_reason, extra_names, extra_values)

        if st.probe is not None:
            probe_ok = gauge(
                "rankguard_probe_ok", "1 if the startup probe succeeded on every rank.", extra_names
            )
            probe_ok.add_metric(extra_values, 1 if st.probe.ok else 0)
            after = gauge(
                "rankguard_probe_free_after_init_bytes",
                "Free GPU memory after communicator init.",
                ["rank", *extra_names],
            )
            comm = gauge(
                "rankguard_probe_comm_bytes", "Memory communicator init took.", ["rank", *extra_names]
            )
            for r in st.probe.ranks:
                after.add_metric([str(r.rank), *extra_values], r.free_after_bytes)
                comm.add_metric([str(r.rank), *extra_values], r.comm_bytes)
            yield from (probe_ok, after, comm)


def build_app(state: AgentState) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        body = {"status": "ok", "sampler_up": state.sampler.is_up(), "backend": state.backend_name}
        if state.backend_error:
            body["backend_error"] = state.backend_error
        return web.json_response(body)

    # Set when the server shuts down: a held poll answers then, so stopping the agent (a pod's
    # SIGTERM) does not wait out every poll's `wait`.
    closing = asyncio.Event()

    async def shutting_down(_: web.Application) -> None:
        closing.set()

    async def report(request: web.Request) -> web.Response:
        if "wait" not in request.query:
            return web.Response(body=state.report().to_json(), content_type="application/json")
        try:
            wait = min(max(float(request.query["wait"]), 0.0), MAX_WAIT_SECONDS)
            lines = parse_lines(request.query.get("lines"))
        except ValueError as e:
            usage = "/report?wait=<seconds>&since=<token>&lines=<bytes>,<bytes>"
            raise web.HTTPBadRequest(text=f"{usage}: {e}") from e
        before = state.answered(request.query.get("since"))
        current = state.report()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        # An unknown `since` (a first poll, a restarted agent) is answered at once.
        while before is not None and news(before, current, lines) is None and not closing.is_set():
            left = deadline - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(closing.wait(), min(POLL_CHECK_SECONDS, left))
            current = state.report()
        return web.Response(
            body=current.to_json(),
            content_type="application/json",
            headers={REPORT_TOKEN_HEADER: state.remember(current)},
        )

    async def metrics(_: web.Request) -> web.Response:
        # one collector per scrape: it carries the engine's usage read for this scrape only
        kv_usage = await state.read_kv_usage()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(AgentCollector(state, kv_usage))
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.on_shutdown.append(shutting_down)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/report", report)
    app.router.add_get("/metrics", metrics)
    return app


def dual_stack_socket(port: int) -> socket.socket:
    """A listening socket on every IPv6 and IPv4 address (`::` with IPV6_V6ONLY off), as vLLM's
    own server binds `--host ::`. asyncio would set IPV6_V6ONLY, and on a dual-stack cluster
    whose pod IP is IPv4 the operator could then not reach the agent."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class AgentServer:
    """The running site; `port` is the bound one (useful with port 0)."""

    def __init__(self, state: AgentState, host: str, port: int) -> None:
        self.state = state
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> int:
        runner = web.AppRunner(build_app(self.state), access_log=None)
        await runner.setup()
        site: web.BaseSite
        try:
            if self.host == "::":
                site = web.SockSite(runner, dual_stack_socket(self.requested_port))
            else:
                site = web.TCPSite(runner, self.host, self.requested_port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        addresses = runner.addresses
        self.port = int(addresses[0][1]) if addresses else self.requested_port
        log.info("serving /healthz /report /metrics on http://%s:%s", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
