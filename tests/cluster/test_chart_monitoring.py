"""Monitoring and `helm test`, against the real prometheus-operator CRDs and a real API server.

- the PrometheusRule carries files/alerts.yaml's groups unchanged (Prometheus' own {{ }}
  templates included), and files/capacity-rules.yaml's recording group after them with
  metrics.prometheusRule.capacityRules (off by default, refused without the PrometheusRule),
  the dashboard ConfigMap carries files/dashboard.json, the PodMonitor selects what the
  operator really renders for a serving pod (`rankguard render`), the NetworkPolicy lets
  Prometheus reach the agent port only when allowed; all off by default.
- the API server, with prometheus-operator's own CRDs installed (from its Go module, the
  same way hack/testbin gets Kubernetes), accepts them, and refuses a broken PodMonitor.
- the `helm test` pod passes on the operator's real /metrics and fails, saying why, on a
  page without rankguard_operator_build_info or no page at all; it is a restricted test hook.

Running the test pod in the cluster would need a kubelet that pulls images; its script is run
here with this Python instead, against a local HTTP server.

Helpers (render, template, by_kind, dry_run_apply, …) are test_chart.py's.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
import yaml
from kubernetes import client
from test_chart import (
    CHART,
    REPO,
    RESTRICTED,
    by_kind,
    delete_namespace,
    dry_run_apply,
    dry_run_create_pod,
    make_namespace,
    render,
    template,
)

from rankguard_operator.edge import metrics as operator_metrics
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

# prometheus-operator's CRDs come from its Go module (example/prometheus-operator-crd/).
PROMETHEUS_OPERATOR = "github.com/prometheus-operator/prometheus-operator@v0.85.0"
MONITORING_CRDS = ("servicemonitors", "podmonitors", "prometheusrules")
ALL_ON = [
    "--set",
    "metrics.serviceMonitor.enabled=true,metrics.prometheusRule.enabled=true,metrics.dashboard.enabled=true",
    "--set",
    "agentPodMonitor.enabled=true,agentPodMonitor.labels.release=kps,metrics.prometheusRule.labels.release=kps",
    "--set",
    "metrics.prometheusRule.capacityRules=true",
]


def prometheus_operator_crds() -> list[Path]:
    """The CRD files of the pinned prometheus-operator module (downloaded once into Go's
    module cache, through the Go module proxy like the control-plane binaries)."""
    go = shutil.which("go")
    assert go, "Go is needed (as for hack/testbin/build.sh) to fetch prometheus-operator's CRDs"
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    with tempfile.TemporaryDirectory() as outside_any_module:
        r = subprocess.run(
            [go, "mod", "download", "-json", PROMETHEUS_OPERATOR],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=outside_any_module,
            env=env,
        )
    assert r.returncode == 0, f"go mod download {PROMETHEUS_OPERATOR} failed: {r.stdout}{r.stderr}"
    crds = Path(json.loads(r.stdout)["Dir"]) / "example" / "prometheus-operator-crd"
    return [crds / f"monitoring.coreos.com_{plural}.yaml" for plural in MONITORING_CRDS]


@pytest.fixture(scope="module")
def monitoring_crds(cluster: ControlPlane) -> None:
    for path in prometheus_operator_crds():
        cluster.kubectl("apply", "--server-side", "--field-manager=rankguard-tests", "-f", str(path))
    for plural in MONITORING_CRDS:
        wait_for(
            f"API discovery to serve {plural}.monitoring.coreos.com",
            lambda plural=plural: cluster.kubectl("get", plural, "-A", check=False).returncode == 0,
            60,
            every=0.3,
        )


# --------------------------------------------------------------------------- the objects
def test_monitoring_is_off_by_default() -> None:
    kinds = {d["kind"] for d in render("ops")}
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"} & kinds


def test_the_prometheus_rule_carries_files_alerts_yaml() -> None:
    (rule,) = by_kind(render("ops", *ALL_ON), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "ops"
    assert rule["metadata"]["labels"]["release"] == "kps"
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    capacity = yaml.safe_load((CHART / "files" / "capacity-rules.yaml").read_text())
    assert set(alerts) == set(capacity) == {"groups"}  # Prometheus rules files, as promtool reads them
    assert rule["spec"] == {"groups": alerts["groups"] + capacity["groups"]}


def test_the_capacity_rules_are_off_by_default_and_need_the_prometheus_rule() -> None:
    (rule,) = by_kind(render("ops", "--set", "metrics.prometheusRule.enabled=true"), "PrometheusRule")
    alerts = yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())
    assert rule["spec"] == {"groups": alerts["groups"]}
    assert not any("record" in r for g in rule["spec"]["groups"] for r in g["rules"])
    # Asked for without the PrometheusRule: refused, saying what to set (never silently nothing).
    r = template("--set", "metrics.prometheusRule.capacityRules=true", check=False)
    assert r.returncode != 0
    assert "set metrics.prometheusRule.enabled=true too" in r.stderr, r.stderr


def chart_with_alerts(tmp_path: Path, alerts: str) -> Path:
    copy = tmp_path / "rankguard"
    shutil.copytree(CHART, copy, symlinks=False)
    (copy / "files" / "alerts.yaml").write_text(alerts)
    return copy


def test_prometheus_templates_in_the_rules_reach_prometheus_untouched(tmp_path: Path) -> None:
    summary = "{{ $labels.namespace }}/{{ $labels.llmservice }}: {{ $value | humanizePercentage }} left"
    alerts = {
        "groups": [
            {
                "name": "g",
                "rules": [{"alert": "A", "expr": "vector(1) > 0", "annotations": {"summary": summary}}],
            }
        ]
    }
    copy = chart_with_alerts(tmp_path / "ok", yaml.safe_dump(alerts))
    (rule,) = by_kind(render("ops", *ALL_ON, chart=copy), "PrometheusRule")
    assert rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"] == summary
    # Not a rules file: refused, naming the file.
    broken = chart_with_alerts(tmp_path / "broken", "rules: []\n")
    r = template(*ALL_ON, chart=broken, check=False)
    assert r.returncode != 0
    assert "files/alerts.yaml to be a Prometheus rules file with top-level groups" in r.stderr, r.stderr


def test_the_dashboard_configmap_carries_files_dashboard_json() -> None:
    docs = render("ops", *ALL_ON, "--set", "metrics.dashboard.namespace=monitoring")
    (cm,) = by_kind(docs, "ConfigMap")
    text = (CHART / "files" / "dashboard.json").read_text()
    json.loads(text)
    assert cm["data"] == {"rankguard.json": text.rstrip("\n")}
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # Grafana's sidecar label
    (cm,) = by_kind(render("ops", *ALL_ON), "ConfigMap")
    assert cm["metadata"]["namespace"] == "ops"


def rendered_serving_pod() -> dict[str, Any]:
    """The pod template of the serving Deployment the operator renders for the example."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "rankguard_operator",
            "render",
            "-f",
            str(REPO / "examples" / "llama3-70b-tp4.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (deploy,) = [d for d in yaml.safe_load_all(r.stdout) if d and d["kind"] == "Deployment"]
    template_: dict[str, Any] = deploy["spec"]["template"]
    return template_


def test_the_agent_pod_monitor_scrapes_what_the_operator_renders() -> None:
    (pm,) = by_kind(render("ops", *ALL_ON), "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "kps"
    serving = rendered_serving_pod()
    assert pm["spec"]["selector"]["matchLabels"].items() <= serving["metadata"]["labels"].items()
    ports = {p["name"] for c in serving["spec"]["containers"] for p in c.get("ports", [])}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports
    assert endpoint["path"] == "/metrics"
    assert (endpoint["interval"], endpoint["scrapeTimeout"]) == ("30s", "10s")
    # The operator's own pod is never a target.
    (deploy,) = by_kind(render("ops", *ALL_ON), "Deployment")
    operator_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert not pm["spec"]["selector"]["matchLabels"].items() <= operator_labels.items()
    # Where: every namespace, the watched ones, or what was given.
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    for values, selector in (
        (["--set", "watchNamespaces={team-a,team-b}"], {"matchNames": ["team-a", "team-b"]}),
        (["--set", "rbac.namespaced=true"], {"matchNames": ["ops"]}),
        (["--set", "agentPodMonitor.namespaceSelector.matchNames={llm}"], {"matchNames": ["llm"]}),
    ):
        (pm,) = by_kind(render("ops", *ALL_ON, *values), "PodMonitor")
        assert pm["spec"]["namespaceSelector"] == selector


def agent_peers(*values: str) -> list[dict[str, Any]]:
    docs = render("ops", "--set", "networkPolicy.enabled=true,networkPolicy.namespaces={team-a}", *values)
    (policy,) = by_kind(docs, "NetworkPolicy")
    agent_rule = policy["spec"]["ingress"][0]
    assert agent_rule["ports"] == [{"port": "agent", "protocol": "TCP"}]
    peers: list[dict[str, Any]] = agent_rule["from"]
    return peers


def test_the_network_policy_lets_prometheus_reach_the_agent_port_only_when_allowed() -> None:
    assert len(agent_peers()) == 1  # the operator only
    operator, prometheus = agent_peers("--set", "networkPolicy.allowMonitoring.enabled=true")
    assert operator["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ops"}}
    assert prometheus == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    _, prometheus = agent_peers(
        "--set",
        "networkPolicy.allowMonitoring.enabled=true,networkPolicy.allowMonitoring.namespace=obs",
        "--set-json",
        'networkPolicy.allowMonitoring.podSelector={"matchExpressions": [{"key": "app", "operator": "In",'
        ' "values": ["prometheus", "vmagent"]}]}',
    )
    assert prometheus["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "obs"}}
    assert prometheus["podSelector"]["matchExpressions"][0]["values"] == ["prometheus", "vmagent"]


def test_the_api_server_accepts_the_monitoring_objects_and_refuses_a_broken_one(
    cluster: ControlPlane, crd: str, monitoring_crds: None, namespace: str
) -> None:
    docs = render(
        namespace,
        *ALL_ON,
        "--set",
        f"networkPolicy.enabled=true,networkPolicy.namespaces={{{namespace}}},networkPolicy.allowMonitoring.enabled=true",
    )
    monitoring = [
        d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap")
    ]
    assert len(monitoring) == 4
    dry_run_apply(cluster, [*monitoring, *by_kind(docs, "NetworkPolicy")])
    # The CRDs' schemas are really checked: a PodMonitor scraping "soon" is refused.
    (pm,) = by_kind(monitoring, "PodMonitor")
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = "soon"
    r = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "-f", "-", input=yaml.safe_dump(pm), check=False
    )
    assert r.returncode != 0
    assert "interval" in r.stderr, r.stderr


# --------------------------------------------------------------------------- helm test
def helm_test_pod(*values: str) -> dict[str, Any]:
    (pod,) = by_kind(render("ops", *values), "Pod")
    return pod


@pytest.fixture
def metrics_page() -> Iterator[tuple[str, list[bytes]]]:
    """A local HTTP server answering /metrics with the body in the list it yields."""
    body: list[bytes] = [b""]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body[0])

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics", body
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def run_test_script(url: str) -> subprocess.CompletedProcess[str]:
    """The test pod's command, with this Python for the image's and `url` for the Service's."""
    (c,) = helm_test_pod()["spec"]["containers"]
    python, flag, script, _service_url = c["command"]
    assert (python, flag) == ("python", "-c")
    return subprocess.run(
        [sys.executable, flag, script, url], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_helm_test_passes_on_the_operators_metrics_and_fails_without_them(
    metrics_page: tuple[str, list[bytes]],
) -> None:
    url, body = metrics_page
    # What the operator's metrics server serves: the default registry, its metrics in it.
    assert operator_metrics.BUILD_INFO in prometheus_client.REGISTRY._collector_to_names
    body[0] = prometheus_client.generate_latest()
    passed = run_test_script(url)
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout.startswith("PASS: rankguard_operator_build_info{"), passed.stdout
    body[0] = b"# HELP other Something else.\nother 1\n"
    failed = run_test_script(url)
    assert failed.returncode == 1
    assert "without rankguard_operator_build_info" in failed.stderr, failed.stderr
    unreachable = run_test_script("http://127.0.0.1:1/metrics")
    assert unreachable.returncode == 1
    assert "cannot read http://127.0.0.1:1/metrics" in unreachable.stderr, unreachable.stderr


def test_the_helm_test_pod_is_a_restricted_hook_on_the_metrics_service(
    cluster: ControlPlane, api: client.ApiClient
) -> None:
    docs = render("ops")
    pod = helm_test_pod()
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (svc,) = by_kind(docs, "Service")
    port = svc["spec"]["ports"][0]["port"]
    assert (
        pod["spec"]["containers"][0]["command"][-1]
        == f"http://{svc['metadata']['name']}.ops.svc:{port}/metrics"
    )
    (deploy,) = by_kind(docs, "Deployment")
    assert (
        pod["spec"]["containers"][0]["image"] == deploy["spec"]["template"]["spec"]["containers"][0]["image"]
    )
    # Never selected by the operator's Deployment or Service (component=test).
    assert not svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert by_kind(render("ops", "--set", "metrics.service.enabled=false"), "Pod") == []
    # Admitted where "restricted" is enforced.
    core = client.CoreV1Api(api)
    ns = make_namespace(core, "t-chart-helm-test", RESTRICTED)
    try:
        (pod,) = by_kind(render(ns), "Pod")
        r = dry_run_create_pod(cluster, ns, pod["spec"])
        assert r.returncode == 0, r.stderr
    finally:
        delete_namespace(core, ns)
