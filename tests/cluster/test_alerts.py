"""The chart's alerting rules and dashboard (charts/rankguard/files/): promtool accepts the
rules and their unit tests (tests/alerts/) pass, and every metric and label they use, and that
the dashboard's queries use, is one the operator or the agent really exports: read from the
/metrics of a real operator (in this process, on the real API server, driven through Running, a
CUDA OOM, a refused apply and an invalid spec) and of a real agent. docs/alerts.md is the
runbook; every alert's runbook_url must point at its section there.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_world import GiB, ReportServer, World, cuda_oom, operator, service_doc, valid_report
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device, write_proc
from rankguard_agent.sampler import Sampler
from rankguard_agent.server import AgentServer, AgentState, const_labels_from_env
from rankguard_sim.kube import testbin
from rankguard_sim.kube.cluster import free_port
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "charts" / "rankguard" / "files" / "alerts.yaml"
# The recording rules for scalers; their names are checked against the agent, the operator and
# the recorded vLLM releases by tests/unit/house/test_capacity_rules.py.
CAPACITY_RULES = REPO / "charts" / "rankguard" / "files" / "capacity-rules.yaml"
DASHBOARD = REPO / "charts" / "rankguard" / "files" / "dashboard.json"
RULE_TESTS = sorted((REPO / "tests" / "alerts").glob("*.yaml"))
RUNBOOK = REPO / "docs" / "alerts.md"
RUNBOOK_URL = re.compile(r"^https://\S+/docs/alerts\.md#([a-z0-9-]+)$")

# Labels Prometheus itself puts on what it scrapes (the target's), not the exporter's.
TARGET_LABELS = frozenset({"job", "instance", "pod", "container", "endpoint", "service"})
# Label values the rules match on that the drive below does not produce, each a value the
# metric's contract names (docs/operations.md, "Metrics").
NOT_DRIVEN = {
    ("rankguard_operator_remediations_total", "action", "Rollback"),
    ("rankguard_operator_reconcile_errors_total", "kind", "api-unavailable"),
}
# Families that have a sample only after an hour of serving (the memory trend's fit), so the drive
# below exports them empty; their labels, which a sample would carry, are what the unit test of
# their export (tests/unit/core/observe/test_memory_trend.py) sees.
NEED_HOURS = {
    "rankguard_llmservice_headroom_trend_bytes_per_hour": {"namespace", "llmservice"},
    "rankguard_llmservice_headroom_exhaustion_hours": {"namespace", "llmservice"},
}


# --------------------------------------------------------------------------------------------
# promtool (built by hack/testbin/build.sh next to kubectl; CI builds it, so missing is a failure)


@pytest.fixture(scope="module")
def promtool() -> Path:
    try:
        folder = testbin.testbin_dir()
    except testbin.TestbinMissing as e:
        pytest.fail(f"promtool is needed and the testbin is not built: {e}", pytrace=False)
    path = folder / "promtool"
    if not path.is_file():
        pytest.fail(
            f"promtool is missing from {folder}: build it with `bash hack/testbin/build.sh` "
            "(`make testbin`), which puts it there",
            pytrace=False,
        )
    return path


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, check=False)


def test_promtool_accepts_the_rules(promtool: Path) -> None:
    r = run(promtool, "check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in r.stdout, r.stdout


def test_promtool_accepts_the_capacity_rules(promtool: Path) -> None:
    r = run(promtool, "check", "rules", CAPACITY_RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 3 rules found" in r.stdout, r.stdout


def test_the_rules_unit_tests_pass(promtool: Path) -> None:
    assert RULE_TESTS, "no promtool unit tests in tests/alerts/"
    r = run(promtool, "test", "rules", *RULE_TESTS)
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------------------------
# The rule file's own shape: each alert labelled, explained, tested both ways, and run-booked


def alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def rule_tests() -> Iterator[dict[str, Any]]:
    """The alerts' promtool tests (a file of the capacity rules' tests is left out)."""
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        files = [(path.parent / f).resolve() for f in doc["rule_files"]]
        assert files in ([RULES], [CAPACITY_RULES]), path
        if files == [RULES]:
            yield from doc["tests"]


def test_every_alert_is_labelled_explained_tested_both_ways_and_has_a_runbook() -> None:
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", m.group(1).strip().lower()).replace(" ", "-")
        for m in re.finditer(r"^#+ (.+)$", RUNBOOK.read_text(), re.MULTILINE)
    }
    fired: set[str] = set()
    held: set[str] = set()
    for case in rule_tests():
        for check in case.get("alert_rule_test") or []:
            (fired if check.get("exp_alerts") else held).add(check["alertname"])
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)), names
    for a in alerts():
        name = a["alert"]
        assert name.startswith("RankGuard"), name
        assert a["labels"]["severity"] in ("critical", "warning", "info"), name
        assert {"summary", "description", "runbook_url"} <= set(a["annotations"]), name
        assert "$labels" in a["annotations"]["summary"] or "absent(" in a["expr"], name
        url = RUNBOOK_URL.match(a["annotations"]["runbook_url"])
        assert url and url.group(1) == name.lower(), a["annotations"]["runbook_url"]
        assert url.group(1) in anchors, f"docs/alerts.md has no section {name}"
        assert name in fired, f"no promtool test in tests/alerts/ makes {name} fire"
        assert name in held, f"no promtool test in tests/alerts/ holds {name} back"


def test_the_dashboard_is_templated_and_laid_out() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["schemaVersion"] >= 39 and doc["uid"] == "rankguard"
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"namespace", "llmservice"} <= set(variables)
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), ids
    taken: set[tuple[int, int]] = set()
    for panel in doc["panels"]:
        g = panel["gridPos"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert g["x"] + g["w"] <= 24 and not cells & taken, f"panel {panel['title']!r} overlaps another"
        taken |= cells
        for target in panel.get("targets") or []:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            if panel["type"] != "row" and "rankguard_llmservice" in target["expr"]:
                assert "$namespace" in target["expr"] and "$llmservice" in target["expr"], panel["title"]


# --------------------------------------------------------------------------------------------
# What the rules, their tests and the dashboard use, read out of PromQL


@dataclass
class Uses:
    """Metric names with the labels matched on them, label values matched exactly, and the
    labels used to group or join (which one of the expression's metrics must carry)."""

    where: str
    metrics: dict[str, set[str]] = field(default_factory=dict)
    values: set[tuple[str, str, str]] = field(default_factory=set)
    grouping: set[str] = field(default_factory=set)


KEYWORDS = frozenset(
    {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right"}
    | {"offset", "bool", "inf", "nan", "start", "end"}
)
STRING = r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`'
MATCHER = re.compile(rf"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*({STRING})\s*,?")
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
SELECTOR = re.compile(r"(?<![\w:$.])([A-Za-z_:][A-Za-z0-9_:]*)(?![\w:])\s*(\{[^{}]*\})?(?!\s*\()")
LABEL_VALUES = re.compile(r"label_values\(\s*([^,()]+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")


def parse_promql(expr: str, uses: Uses) -> None:
    """Every selector of `expr` (a bare name or name{…}; not a function, a keyword, a duration
    or a Grafana variable), its matchers, and the labels of by/without/on/ignoring clauses."""
    expr = re.sub(r"\$__\w+", "5m", expr)  # Grafana's interval variables, in [ ]
    expr = re.sub(r"\$\{\w+(?::\w+)?\}|\$\w+", "x", expr)  # the others, in matchers' strings
    for m in LABEL_VALUES.finditer(expr):  # Grafana's label_values(selector, label)
        parse_promql(m.group(1), uses)
        uses.grouping.add(m.group(2))
    expr = LABEL_VALUES.sub(" 0 ", expr)
    for m in GROUPING.finditer(expr):
        uses.grouping.update(label.strip() for label in m.group(2).split(",") if label.strip())
    expr = GROUPING.sub(" ", expr)
    for m in SELECTOR.finditer(expr):
        name, braces = m.group(1), m.group(2)
        if name in KEYWORDS:
            assert not braces, f"{uses.where}: {m.group(0)!r}"
            continue
        labels = uses.metrics.setdefault(name, set())
        if braces:
            body = braces[1:-1]
            consumed = 0
            for mm in MATCHER.finditer(body):
                assert mm.start() == consumed, f"{uses.where}: cannot read matchers {braces!r}"
                consumed = mm.end()
                label, op, quoted = mm.group(1), mm.group(2), mm.group(3)
                labels.add(label)
                if op in ("=", "!="):
                    uses.values.add((name, label, quoted[1:-1].replace('\\"', '"')))
            assert consumed == len(body) or not body[consumed:].strip(), f"{uses.where}: {braces!r}"


def test_the_promql_reader_finds_selectors_matchers_and_groupings() -> None:
    uses = Uses("example")
    parse_promql(
        'sum by (namespace, rank) (increase(a_total{reason="cuda-oom", x!~"y"}[15m] offset 1h))'
        " / on (job) group_left max without (instance) (b) > bool 0.2 and c{d='e'}"
        ' or label_values(f{g=~"$namespace"}, h) + rate(i[$__rate_interval]) + time()',
        uses,
    )
    assert uses.metrics == {"a_total": {"reason", "x"}, "b": set(), "c": {"d"}, "f": {"g"}, "i": set()}
    assert uses.values == {("a_total", "reason", "cuda-oom"), ("c", "d", "e")}
    assert uses.grouping == {"namespace", "rank", "job", "instance", "h"}


def used_by_the_rules() -> list[Uses]:
    out = []
    for a in alerts():
        uses = Uses(f"alert {a['alert']}")
        parse_promql(a["expr"], uses)
        # A query in an annotation's template: {{ printf "selector{…=\"%s\"}" … | query }}; its
        # %s are the alert's own labels, not values to look for.
        for text in a["annotations"].values():
            for q in re.findall(r'printf\s+"((?:[^"\\]|\\.)*)"[^}]*\|\s*query', text):
                query = Uses(uses.where)
                parse_promql(q.replace('\\"', '"'), query)
                for name, labels in query.metrics.items():
                    uses.metrics.setdefault(name, set()).update(labels)
                uses.grouping |= query.grouping
                uses.values |= {v for v in query.values if v[2] != "%s"}
        out.append(uses)
    return out


def used_by_the_rule_tests() -> list[Uses]:
    out = []
    for case in rule_tests():
        uses = Uses(f"promtool test {case['name']!r}")
        for series in case.get("input_series") or []:
            parse_promql(series["series"], uses)
        out.append(uses)
    return out


def used_by_the_dashboard() -> list[Uses]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets") or []:
            uses = Uses(f"dashboard panel {panel['title']!r}")
            parse_promql(target["expr"], uses)
            out.append(uses)
    for var in doc["templating"]["list"]:
        if var["type"] == "query":
            uses = Uses(f"dashboard variable {var['name']}")
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            parse_promql(query, uses)
            out.append(uses)
    return out


# --------------------------------------------------------------------------------------------
# What is really exported


@dataclass
class Exposition:
    labels: dict[str, set[str]] = field(default_factory=dict)  # sample name -> label names
    values: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (name, label) -> values
    empty: set[str] = field(default_factory=set)  # families exported without a sample

    def read(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            if not family.samples:
                self.empty.add(family.name)
            for sample in family.samples:
                self.labels.setdefault(sample.name, set()).update(sample.labels)
                for label, value in sample.labels.items():
                    self.values.setdefault((sample.name, label), set()).add(value)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return str(r.read().decode())


def operator_exposition(world: World) -> str:
    """The real operator's /metrics, after a drive through every state the rules watch:
    Running with agents reporting (and one scrape refused), a CUDA OOM and the shrink it
    brings, an apply the API server refuses, and a spec that cannot be served."""
    ns = world.ns
    port = free_port()
    with ReportServer(port) as agent, operator(ns):
        agent.serve(b"{}", status=500)  # the first scrapes fail: reports_rejected_total
        world.create(service_doc("llama", port))
        world.ready_service("llama")
        pod = world.new_pod("llama")["metadata"]["name"]
        world.kubelet_ready(pod)
        wait_for("a rejected report", lambda: sample("rankguard_operator_reports_rejected_total", ns))
        agent.serve(lambda: valid_report((3 * GiB, 2 * GiB)))
        wait_for("Ready", lambda: world.condition("llama", "Ready").get("status") == "True")

        generation = world.generation("llama")
        world.kubelet_terminated(pod, cuda_oom(rank=0, requested=2 * GiB, free=3 * GiB // 2))
        wait_for("the shrink's roll", lambda: world.generation("llama") > generation)
        world.kubelet_ready(world.new_pod("llama", not_in=(pod,))["metadata"]["name"])
        wait_for(
            "Ready again, with both ranks' headroom",
            lambda: (
                world.condition("llama", "Ready").get("status") == "True"
                and len(sample("rankguard_llmservice_rank_headroom_bytes", ns)) == 2
            ),
        )

        # The API server refuses a second Deployment in this namespace: a pass that fails.
        world.core.create_namespaced_resource_quota(
            ns, {"metadata": {"name": "one-deployment"}, "spec": {"hard": {"count/deployments.apps": "1"}}}
        )
        world.create(service_doc("refused", free_port()))
        wait_for(
            "ApplyRefused", lambda: world.condition("refused", "Degraded").get("reason") == "ApplyRefused"
        )
        # A flag the image's vLLM does not have: InvalidSpec, phase Failed.
        engine = {"maxModelLen": 8192, "maxNumSeqs": 64, "extraArgs": ["--enable-frobnication"]}
        world.create(service_doc("invalid", free_port(), engine=engine))
        wait_for("phase Failed", lambda: world.status("invalid").get("phase") == "Failed")
        world.let_the_loop_look("llama")
        world.let_the_loop_look("refused")

        assert agent.requests > 0
        # Served as `python -m rankguard_operator` serves it (prometheus_client's own server).
        server, thread = start_http_server(free_port(), addr="127.0.0.1", registry=REGISTRY)
        try:
            return scrape(f"http://127.0.0.1:{server.server_port}/metrics")
        finally:
            server.shutdown()
            server.server_close()
            thread.join(10)


def sample(name: str, namespace: str) -> list[dict[str, str]]:
    """The labels of `name`'s samples about `namespace` in this process's registry."""
    return [
        dict(s.labels)
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == name and s.labels.get("namespace") == namespace
    ]


async def agent_exposition(tmp_path: Path) -> str:
    """A real agent's /metrics: its server on a simulated node of two GPUs, with the labels the
    operator gives its pod."""
    write_device(tmp_path, "GPU-aa", index=0, total_bytes=80 * GiB)
    write_device(tmp_path, "GPU-bb", index=1, total_bytes=80 * GiB)
    write_proc(tmp_path, "GPU-aa", "vllm", 40 * GiB)
    sampler = Sampler(SimBackend(tmp_path, {}), hz=10, window_seconds=30)
    sampler.sample_once()
    labels = const_labels_from_env({"RANKGUARD_LLMSERVICE": "llama", "POD_NAMESPACE": "llm"})
    server = AgentServer(AgentState(sampler=sampler, backend_name="sim", const_labels=labels), "127.0.0.1", 0)
    port = await server.start()
    try:
        # urllib blocks: off the loop that serves the request
        return str(await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics"))
    finally:
        await server.stop()


def test_every_metric_and_label_used_is_exported(world: World, tmp_path: Path) -> None:
    exported = Exposition()
    exported.read(operator_exposition(world))
    exported.read(asyncio.run(agent_exposition(tmp_path)))
    for name, labels in NEED_HOURS.items():
        assert name in exported.empty, f"{name} is not exported, or now has a sample: drop it from NEED_HOURS"
        exported.labels[name] = set(labels)

    problems = []
    for uses in used_by_the_rules() + used_by_the_rule_tests() + used_by_the_dashboard():
        carried: set[str] = set(TARGET_LABELS)
        for name, labels in sorted(uses.metrics.items()):
            if name not in exported.labels:
                empty = {name, name.removesuffix("_total")} & exported.empty
                why = "exported without a sample in this drive" if empty else "not exported"
                problems.append(f"{uses.where}: metric {name} is {why}")
                continue
            carried |= exported.labels[name]
            for label in sorted(labels - exported.labels[name] - TARGET_LABELS):
                problems.append(f"{uses.where}: {name} has no label {label!r}")
        for label in sorted(uses.grouping - carried):
            problems.append(f"{uses.where}: no metric of it carries the label {label!r} it groups by")
        if uses.where.startswith("alert "):
            for name, label, value in sorted(uses.values - NOT_DRIVEN):
                seen = exported.values.get((name, label), set())
                if value not in seen and label not in TARGET_LABELS:
                    problems.append(f"{uses.where}: {name}{{{label}={value!r}}}, exported: {sorted(seen)}")
    assert not problems, "\n".join(problems)
