"""The operator's own Prometheus metrics (served by prometheus_client, never hand-written).

Every series about one LLMService carries `namespace` and `llmservice` labels and goes when
the service goes (`forget_service`); other labels take a bounded set of values (reasons,
actions, ranks up to the service's world size). docs/operations.md lists them all.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankguard_operator import __version__
from rankguard_operator.core.status.figures import PHASES, Figures

REPORTS_OK = Counter(
    "rankguard_operator_reports_accepted_total",
    "Agent reports that parsed and validated",
    ["namespace", "llmservice"],
)
REPORTS_REJECTED = Counter(
    "rankguard_operator_reports_rejected_total",
    "Agent reports ignored as no data: unreachable, non-200, oversized or malformed",
    ["namespace", "llmservice", "reason"],
)
REMEDIATIONS = Counter(
    "rankguard_operator_remediations_total",
    "Deployment rolls the operator made to change memory flags, by action and trigger",
    ["namespace", "llmservice", "action", "trigger"],
)
RECONCILE_SECONDS = Histogram(
    "rankguard_operator_reconcile_seconds",
    "Time for one pass of an LLMService's loop (observe, decide, act)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
)
PASSES = Counter(
    "rankguard_operator_passes_total",
    "Passes of an LLMService's loop (observe, decide, act), finished or failed",
    ["namespace", "llmservice"],
)
REPORT_FIELDS_DROPPED = Counter(
    "rankguard_operator_report_fields_dropped_total",
    "Advisory fields of otherwise valid agent reports dropped as malformed (engine version, "
    "engine memory): never acted upon",
    ["namespace", "llmservice"],
)
AGENTS_UNAVAILABLE = Gauge(
    "rankguard_agents_unavailable",
    "Ready serving pods of an LLMService whose agent has sent no valid report for longer than "
    "RANKGUARD_AGENT_UNAVAILABLE_AFTER (the AgentReady condition names them and why)",
    ["namespace", "llmservice"],
)
ENGINE_RULES_FALLBACK = Gauge(
    "rankguard_operator_engine_rules_fallback",
    "1 while an LLMService's vLLM version has no recorded snapshot (or is unknown) and the "
    "nearest one's rules are used (the EngineRules condition says which); 0 otherwise",
    ["namespace", "llmservice"],
)
API_REACHABLE = Gauge(
    "rankguard_operator_api_reachable",
    "1 while the API server answers the operator's calls, 0 from the first failed call of an "
    "outage until one succeeds again (one WARNING log line per outage, not one per call)",
)
API_ERRORS = Counter(
    "rankguard_operator_api_errors_total",
    "API calls (the operator's own and kopf's watch requests) that failed because the API "
    "server was unreachable or answered 5xx; each is retried",
    ["kind"],
)
API_OUTAGES = Counter(
    "rankguard_operator_api_outages_total",
    "Times the API server went from answering to not answering",
)
PODS_IGNORED = Counter(
    "rankguard_operator_pods_ignored_total",
    "Pods carrying an LLMService's labels that its owner chain does not vouch for (not made by "
    "the ReplicaSet of the Deployment rankguard applied for it): never scraped nor acted upon. "
    "Counted once per pod",
    ["namespace", "llmservice", "reason"],
)
OOMS_OBSERVED = Counter(
    "rankguard_operator_ooms_observed_total",
    "Runs of vLLM that ended for memory, as the pods' statuses show them (acted upon or not), "
    "by reason (CUDAOutOfMemory, OOMKilled) and rank (unknown when not reported)",
    ["namespace", "llmservice", "reason", "rank"],
)
RECONCILE_ERRORS = Counter(
    "rankguard_operator_reconcile_errors_total",
    "Passes of an LLMService's loop that failed, by kind: api-unavailable (the API server did "
    "not answer), apply-refused (it refused what rankguard rendered), conflict (a write lost a "
    "race or was throttled; retried), error (anything else; logged with its traceback)",
    ["namespace", "llmservice", "kind"],
)
LAST_PASS = Gauge(
    "rankguard_operator_last_pass_timestamp_seconds",
    "Unix time the last pass of an LLMService's loop finished (time() minus it is the lag)",
    ["namespace", "llmservice"],
)
LEADER = Gauge(
    "rankguard_operator_leader",
    "1 while this operator replica holds the leader Lease (or leader election is off) and "
    "acts; 0 while it waits as a standby",
)
LEADER.set(1)  # leader election off: this replica acts (edge/main sets 0 while it waits)
BUILD_INFO = Gauge(
    "rankguard_operator_build_info",
    "Always 1; the labels say which operator runs",
    ["version", "python_version"],
)
BUILD_INFO.labels(version=__version__, python_version=platform.python_version()).set(1)

# Counters and gauges with a service's labels, dropped when the service goes.
PER_SERVICE = (
    REPORTS_OK,
    REPORTS_REJECTED,
    REMEDIATIONS,
    PASSES,
    REPORT_FIELDS_DROPPED,
    AGENTS_UNAVAILABLE,
    ENGINE_RULES_FALLBACK,
    PODS_IGNORED,
    OOMS_OBSERVED,
    RECONCILE_ERRORS,
    LAST_PASS,
)


class ServiceGauges(Collector):
    """The per-service gauges read from each pass's status (core/status/figures): a snapshot
    per service, exported as it stands at scrape time, so a series that is no longer true
    (an old phase, a rank no longer reported, a deleted service) is simply not there."""

    def __init__(self) -> None:
        self._figures: dict[tuple[str, str], Figures] = {}
        self._lock = threading.Lock()  # scrapes run in prometheus_client's own thread

    def set(self, namespace: str, name: str, figures: Figures) -> None:
        with self._lock:
            self._figures[(namespace, name)] = figures

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._figures.pop((namespace, name), None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = sorted(self._figures.items())
        labels = ["namespace", "llmservice"]
        budget = GaugeMetricFamily(
            "rankguard_llmservice_kv_budget_bytes",
            "The per-GPU KV-cache budget in effect (--kv-cache-memory-bytes); absent while the "
            "service runs on a --gpu-memory-utilization",
            labels=labels,
        )
        rank = GaugeMetricFamily(
            "rankguard_llmservice_rank_headroom_bytes",
            "The lowest free GPU memory the agents sampled on a rank (its worst replica, over "
            "the sampling window); fresh reports only",
            labels=[*labels, "rank"],
        )
        least = GaugeMetricFamily(
            "rankguard_llmservice_min_headroom_bytes",
            "The bottleneck rank's headroom: the least of rankguard_llmservice_rank_headroom_bytes",
            labels=labels,
        )
        target = GaugeMetricFamily(
            "rankguard_llmservice_headroom_target_bytes",
            "spec.memory.minHeadroomBytes: below it for 60 s rankguard shrinks the KV budget",
            labels=labels,
        )
        phase = GaugeMetricFamily(
            "rankguard_llmservice_phase",
            "1 for the LLMService's current phase, 0 for the others",
            labels=[*labels, "phase"],
        )
        trend = GaugeMetricFamily(
            "rankguard_llmservice_headroom_trend_bytes_per_hour",
            "The slope of the bottleneck rank's headroom while serving: least squares over up to "
            "3 h of 5-minute samples, negative while it falls; absent until an hour of samples "
            "since the pods started (a roll or a vLLM restart starts it over)",
            labels=labels,
        )
        exhaustion = GaugeMetricFamily(
            "rankguard_llmservice_headroom_exhaustion_hours",
            "Hours until the bottleneck rank's headroom reaches spec.memory.minHeadroomBytes at "
            "rankguard_llmservice_headroom_trend_bytes_per_hour (0 once there); absent while it "
            "does not fall. The MemoryCreep condition judges it; nothing is restarted for it",
            labels=labels,
        )
        # labelled as vLLM's own series are (model_name), so PromQL divides vllm:* by these
        kv_labels = [*labels, "model_name"]
        capacity = GaugeMetricFamily(
            "rankguard_llmservice_kv_capacity_tokens",
            "Tokens of KV cache ONE replica holds, as vLLM counts them: the plan's figure for the "
            "flags in effect until an engine running them reports its own 'KV cache size' (the "
            "lowest over replicas), then that figure; kept at 0 replicas until the flags change "
            "(status.capacity, its source says which)",
            labels=kv_labels,
        )
        concurrency = GaugeMetricFamily(
            "rankguard_llmservice_kv_max_concurrency",
            "Requests of max-model-len tokens ONE replica's KV cache holds at once (vLLM's "
            "'Maximum concurrency' figure: capacity over max-model-len), planned until an engine "
            "reports, as rankguard_llmservice_kv_capacity_tokens",
            labels=kv_labels,
        )
        condition = GaugeMetricFamily(
            "rankguard_llmservice_condition",
            "Always 1, one series per condition type: its status and reason as labels",
            labels=[*labels, "condition", "status", "reason"],
        )
        for (ns, name), f in items:
            if f.kv_budget_bytes is not None:
                budget.add_metric([ns, name], f.kv_budget_bytes)
            for r, headroom in f.rank_headroom:
                rank.add_metric([ns, name, str(r)], headroom)
            if f.min_headroom_bytes is not None:
                least.add_metric([ns, name], f.min_headroom_bytes)
            if f.headroom_target_bytes is not None:
                target.add_metric([ns, name], f.headroom_target_bytes)
            if f.headroom_trend_bytes_per_hour is not None:
                trend.add_metric([ns, name], f.headroom_trend_bytes_per_hour)
            if f.headroom_exhaustion_hours is not None:
                exhaustion.add_metric([ns, name], f.headroom_exhaustion_hours)
            if f.kv_capacity_tokens is not None and f.model_name is not None:
                capacity.add_metric([ns, name, f.model_name], f.kv_capacity_tokens)
            if f.kv_max_concurrency is not None and f.model_name is not None:
                concurrency.add_metric([ns, name, f.model_name], f.kv_max_concurrency)
            for p in PHASES:
                phase.add_metric([ns, name, p], 1 if p == f.phase else 0)
            for type_, status, reason in f.conditions:
                condition.add_metric([ns, name, type_, status, reason], 1)
        yield from (budget, rank, least, target, trend, exhaustion, capacity, concurrency, phase, condition)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families are built at scrape time


SERVICE_GAUGES = ServiceGauges()
REGISTRY.register(SERVICE_GAUGES)


def forget_service(namespace: str, name: str) -> None:
    """Drop every series of a deleted LLMService (its counters too: a service created again
    under the same name starts from zero, which rate() and increase() read as a reset)."""
    SERVICE_GAUGES.forget(namespace, name)
    for metric in PER_SERVICE:
        metric.remove_by_labels({"namespace": namespace, "llmservice": name})
