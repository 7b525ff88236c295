"""The operator's own Prometheus metrics (served by prometheus_client, never hand-written)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
