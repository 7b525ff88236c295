"""Across modules: the chart's recording rules for scalers (charts/rankguard/files/capacity-rules.yaml)
and their promtool tests (tests/alerts/capacity_rules.yaml) read only series that exist, with
the labels they have:

- every vllm:* series is one the recorded vLLM releases serve (vllm_snapshots/<v>/metrics.json,
  read from the real packages: hack/vllm-snapshot/prom_metrics.py), with vLLM's own labels;
- the agent's rankguard_kv_* series are what the agent's collector yields on the pod that serves
  the engine's HTTP (agent/rankguard_agent/engine_metrics.py), with the labels the operator gives
  its pod;
- the operator's series are what its collector exports (edge/metrics.py).

The labels a scrape adds (job, instance, pod; namespace for vLLM's series) are the target's.
promtool itself (check rules, test rules) runs in tests/cluster/test_alerts.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankguard_agent.engine_metrics import capacity_series
from rankguard_agent.server import const_labels_from_env
from rankguard_operator import vllm_snapshots
from rankguard_operator.core.status.figures import Figures
from rankguard_operator.edge.metrics import LEADER, ServiceGauges
from tests import REPO

RULES = REPO / "charts" / "rankguard" / "files" / "capacity-rules.yaml"
RULE_TESTS = REPO / "tests" / "alerts" / "capacity_rules.yaml"
# The shared design of issue 52: the three names scalers and the examples read.
RECORDED = {
    "rankguard:llmservice_kv_used_tokens",
    "rankguard:llmservice_queued_prompt_tokens",
    "rankguard:llmservice_demand_replicas",
}
METRIC = re.compile(r"(?<![\w:])(vllm:[A-Za-z0-9_:]+|rankguard[_:][A-Za-z0-9_:]+)")
SERIES = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)\{(.*)\}$")
# the labels Prometheus adds from the scrape target, by whose series they are
TARGET = {"vllm": {"job", "instance", "namespace", "pod"}, "agent": {"job", "instance", "pod"}}
OPERATOR_TARGET = {"job", "instance"}


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def names_in(expr: str) -> set[str]:
    return set(METRIC.findall(re.sub(r'"[^"]*"', '""', expr)))


def input_series() -> list[tuple[str, dict[str, str]]]:
    out = []
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for row in case["input_series"]:
            m = SERIES.match(row["series"])
            assert m, row["series"]
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels))
    return out


def vllm_samples(version: str) -> dict[str, dict[str, Any]]:
    """Sample name (vllm:request_prompt_tokens_sum, ...) -> its metric's metrics.json entry."""
    return {s: m for m in vllm_snapshots.prometheus_metrics(version).values() for s in m["samples"]}


def agent_exported() -> dict[str, set[str]]:
    labels = const_labels_from_env({"RANKGUARD_LLMSERVICE": "llama", "POD_NAMESPACE": "llm"})
    families = capacity_series(100_000, 0.25, {}, list(labels), list(labels.values()))
    return {s.name: set(s.labels) for f in families for s in f.samples}


def operator_exported() -> dict[str, set[str]]:
    gauges = ServiceGauges()
    figures = Figures(phase="Running", kv_capacity_tokens=50_000, kv_max_concurrency=6.1, model_name="m")
    gauges.set("llm", "llama", figures)
    out = {s.name: set(s.labels) for f in gauges.collect() for s in f.samples}
    out.update({s.name: set(s.labels) for f in LEADER.collect() for s in f.samples})
    return out


def test_the_rules_record_the_three_names_of_the_design() -> None:
    assert {r["record"] for r in rules()} == RECORDED
    assert all("alert" not in r for r in rules())


@pytest.mark.parametrize("version", vllm_snapshots.metrics_versions())
def test_every_vllm_name_the_rules_and_their_tests_read_is_served_by_the_release(version: str) -> None:
    served = vllm_samples(version)
    used = {n for r in rules() for n in names_in(r["expr"]) if n.startswith("vllm:")}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    used |= {
        n for case in tests for check in case.get("promql_expr_test") or [] for n in names_in(check["expr"])
    }
    used = {n for n in used if n.startswith("vllm:")}
    assert used >= {"vllm:num_requests_waiting", "vllm:request_prompt_tokens_sum"}, used
    assert sorted(used - set(served)) == [], f"vLLM {version} serves no such series"
    # a rate() over a histogram's sum and count: both are the same histogram's series
    assert served["vllm:request_prompt_tokens_sum"]["type"] == "histogram"
    assert served["vllm:request_prompt_tokens_count"] is served["vllm:request_prompt_tokens_sum"]
    assert served["vllm:num_requests_waiting"]["type"] == "gauge"
    for name, labels in input_series():
        if name.startswith("vllm:"):
            assert name in served, f"{name}: vLLM {version} serves no such series"
            own = set(labels) - TARGET["vllm"]
            assert own == set(served[name]["labels"]), (name, own, served[name]["labels"])


def test_the_agents_and_operators_series_are_what_they_export() -> None:
    agent, operator = agent_exported(), operator_exported()
    used = {n for r in rules() for n in names_in(r["expr"]) if n.startswith("rankguard_")}
    assert used == {
        "rankguard_kv_capacity_tokens",
        "rankguard_kv_free_tokens",
        "rankguard_llmservice_kv_capacity_tokens",
        "rankguard_operator_leader",
    }
    assert sorted(used - set(agent) - set(operator)) == []
    for name, labels in input_series():
        if name in agent:
            assert set(labels) - TARGET["agent"] == agent[name], name
        elif name in operator:
            assert set(labels) - OPERATOR_TARGET == operator[name], name
        else:
            assert name.startswith("vllm:"), f"{name}: neither rankguard nor vLLM exports it"


def test_the_metric_name_reader_sees_every_kind_of_name() -> None:
    expr = 'sum by (pod) (rate(vllm:a_sum{x="vllm:not"}[5m])) / on (namespace) rankguard:b + rankguard_c'
    assert names_in(expr) == {"vllm:a_sum", "rankguard:b", "rankguard_c"}


def test_the_files_are_where_the_chart_and_promtool_read_them() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    assert [Path(RULE_TESTS.parent, f).resolve() for f in doc["rule_files"]] == [RULES.resolve()]
