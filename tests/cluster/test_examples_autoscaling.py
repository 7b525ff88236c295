"""The examples in examples/autoscaling/ against the real APIs and configuration formats of the
projects they target (third_party/*/README.md: what is vendored, from which release).

* On the cluster tier's kube-apiserver, with KEDA's ScaledObject CRD (v2.20.2) and the Gateway
  API Inference Extension's InferencePool CRD (v1.6.0) installed: every object of every example
  is accepted by a server-side apply dry run (dryRun=All, strict field validation), and a
  misspelt field or a broken rule is refused, so the CRDs really enforce.
* What no API server checks, held against the projects' own sources: the KEDA Prometheus
  trigger's metadata keys (its scaler's `keda:"name=..."` tags), prometheus-adapter's config
  (its config types' yaml tags), the endpoint picker's configuration (llm-d-router's plugin
  types, their parameters' json tags, and its loader's reference rules).
* Against rankguard itself: the recording rules the scalers read are the chart's, the
  InferencePool selects the pods the operator renders and serve HTTP, on the ports it renders,
  and the metric the EPP scores is one the agent serves.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankguard_agent.engine_metrics import capacity_series
from rankguard_operator.cli_render import render_service
from rankguard_operator.core.names import ROLE_LABEL
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.waiting import wait_for
from tests.cluster.example_files import documents, dry_run_lines

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "examples" / "autoscaling"
THIRD = REPO / "third_party"
KEDA = THIRD / "keda" / "v2.20.2"
POOL = THIRD / "gateway-api-inference-extension" / "v1.6.0"
ROUTER = THIRD / "llm-d-router" / "v0.10.0"
ADAPTER = THIRD / "prometheus-adapter" / "v0.12.0"
CRDS = {
    "scaledobjects.keda.sh": KEDA / "keda.sh_scaledobjects.yaml",
    "inferencepools.inference.networking.k8s.io": POOL / "inference.networking.k8s.io_inferencepools.yaml",
}
SCALED_OBJECT = HERE / "keda-scaledobject.yaml"
HPA = HERE / "hpa-external-metric.yaml"
ADAPTER_RULE = HERE / "prometheus-adapter-rule.yaml"
POOL_EPP = HERE / "inferencepool-epp.yaml"
EXAMPLES = sorted(HERE.glob("*.yaml"))
SERVICE_EXAMPLE = REPO / "examples" / "llama3-70b-tp4.yaml"  # the LLMService they all target
EPP_FILE = "rankguard-kv-free-tokens.yaml"
RULE_NAME = re.compile(r"rankguard:[a-z_]+")


def one(path: Path, kind: str) -> dict[str, Any]:
    [doc] = [d for d in documents(path) if d["kind"] == kind]
    return doc


def epp_config() -> dict[str, Any]:
    return dict(yaml.safe_load(one(POOL_EPP, "ConfigMap")["data"][EPP_FILE]))


def adapter_config() -> dict[str, Any]:
    return dict(yaml.safe_load(one(ADAPTER_RULE, "ConfigMap")["data"]["config.yaml"]))


def _established(cluster: ControlPlane, name: str) -> Callable[[], bool]:
    def check() -> bool:
        jsonpath = "jsonpath={.status.conditions[?(@.type=='Established')].status}"
        r = cluster.kubectl("get", f"crd/{name}", "-o", jsonpath, check=False)
        return bool(r.stdout.strip() == "True")

    return check


def _served(cluster: ControlPlane, plural: str) -> Callable[[], bool]:
    return lambda: bool(cluster.kubectl("get", plural, "-A", check=False).returncode == 0)


@pytest.fixture(scope="module")
def crds(cluster: ControlPlane) -> Iterator[None]:
    """The vendored CRDs installed (server-side, as test_lws_dry_run does) and served."""
    for path in CRDS.values():
        cluster.kubectl("apply", "--server-side", "--field-manager=rankguard-tests", "-f", str(path))
    for name in CRDS:
        plural = name.split(".", 1)[0]
        wait_for(f"the CRD {name} to be Established", _established(cluster, name), 60, every=0.3)
        wait_for(f"API discovery to serve {plural}", _served(cluster, plural), 60, every=0.3)
    try:
        yield
    finally:
        for name in CRDS:
            cluster.kubectl("delete", "crd", name, "--wait=false", check=False)


def dry_run(cluster: ControlPlane, namespace: str, *args: str, input: str | None = None) -> Any:
    """Server-side apply, dry run (dryRun=All), fields validated strictly."""
    return cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--validate=strict",
        "--field-manager=rankguard-tests",
        "-n",
        namespace,
        *args,
        input=input,
        check=False,
    )


# --------------------------------------------------------------------------------------------
# The API server


def test_the_examples_are_there() -> None:
    assert {p.name for p in EXAMPLES} == {SCALED_OBJECT.name, HPA.name, ADAPTER_RULE.name, POOL_EPP.name}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_object_is_accepted_by_the_api_server(
    cluster: ControlPlane, crds: None, namespace: str, path: Path
) -> None:
    r = dry_run(cluster, namespace, "-f", str(path))
    assert r.returncode == 0, r.stderr
    for line in dry_run_lines(path, "serverside-applied"):
        assert line in r.stdout, r.stdout


def refused(cluster: ControlPlane, namespace: str, doc: Mapping[str, Any]) -> str:
    r = dry_run(cluster, namespace, "-f", "-", input=json.dumps(doc))
    assert r.returncode != 0, r.stdout
    return str(r.stderr)


def test_a_misspelt_scaled_object_field_is_refused_by_kedas_crd(
    cluster: ControlPlane, crds: None, namespace: str
) -> None:
    doc = copy.deepcopy(one(SCALED_OBJECT, "ScaledObject"))
    doc["spec"]["minReplicaCont"] = doc["spec"].pop("minReplicaCount")
    assert ".spec.minReplicaCont: field not declared in schema" in refused(cluster, namespace, doc)
    doc = copy.deepcopy(one(SCALED_OBJECT, "ScaledObject"))
    del doc["spec"]["triggers"][0]["type"]
    assert "spec.triggers[0].type: Required value" in refused(cluster, namespace, doc)


def test_a_broken_inference_pool_is_refused_by_its_crd(
    cluster: ControlPlane, crds: None, namespace: str
) -> None:
    doc = copy.deepcopy(one(POOL_EPP, "InferencePool"))
    doc["spec"]["targetPort"] = doc["spec"].pop("targetPorts")
    assert ".spec.targetPort: field not declared in schema" in refused(cluster, namespace, doc)
    # the CRD's CEL rule: a Service needs a port
    doc = copy.deepcopy(one(POOL_EPP, "InferencePool"))
    del doc["spec"]["endpointPickerRef"]["port"]
    assert "port is required when kind is 'Service'" in refused(cluster, namespace, doc)


def test_a_misspelt_hpa_field_is_refused(cluster: ControlPlane, crds: None, namespace: str) -> None:
    doc = copy.deepcopy(one(HPA, "HorizontalPodAutoscaler"))
    doc["spec"]["metrics"][0]["external"]["target"]["averageValu"] = "800m"
    del doc["spec"]["metrics"][0]["external"]["target"]["averageValue"]
    assert "averageValu" in refused(cluster, namespace, doc)


# --------------------------------------------------------------------------------------------
# What the projects' own sources accept (no API server holds these)


def _go(path: Path) -> str:
    return path.read_text()


def _tags(source: str, kind: str) -> set[str]:
    """The field names a Go source's struct tags of `kind` (json, yaml) declare."""
    return set(re.findall(rf'{kind}:"([A-Za-z0-9_]+)', source))


def unknown_keys(
    value: Any, known: set[str], where: str = "", *, maps: frozenset[str] = frozenset()
) -> list[str]:
    """Every mapping key in `value`, at any depth, that is not in `known`; the keys of a field
    named in `maps` (a Go map, whose keys are data) are not checked, their values are."""
    out: list[str] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            if k not in known:
                out.append(f"{where}.{k}")
            if k in maps and isinstance(v, Mapping):
                for mk, mv in v.items():
                    out += unknown_keys(mv, known, f"{where}.{k}.{mk}", maps=maps)
            else:
                out += unknown_keys(v, known, f"{where}.{k}", maps=maps)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += unknown_keys(v, known, f"{where}[{i}]", maps=maps)
    return out


def keda_problems(doc: Mapping[str, Any]) -> list[str]:
    """A prometheus trigger's metadata keys that KEDA v2.20.2's Prometheus scaler does not read
    (its CRD takes any string map; the scaler refuses the trigger at run time)."""
    keys = set(re.findall(r'keda:"name=(\w+)', _go(KEDA / "pkg" / "scalers" / "prometheus_scaler.go")))
    return [
        f"triggers[{i}].metadata.{k}"
        for i, t in enumerate(doc["spec"]["triggers"])
        if t["type"] == "prometheus"
        for k in t["metadata"]
        if k not in keys
    ]


def adapter_problems(config: Mapping[str, Any]) -> list[str]:
    """Keys prometheus-adapter v0.12.0 does not declare (it reads the file with
    yaml.UnmarshalStrict, so any of these stops it at start-up)."""
    source = _go(ADAPTER / "pkg" / "config" / "config.go")
    # ResourceMapping.Overrides is a map[string]GroupResource: its keys are Prometheus labels
    maps = frozenset(re.findall(r'map\[string\]\w+\s+`json:"[^"]*"\s+yaml:"(\w+)', source))
    return unknown_keys(config, _tags(source, "yaml"), maps=maps)


def _plugin_sources() -> dict[str, str]:
    """Plugin type -> the vendored Go source that defines it (its `...Type = "<type>"`)."""
    out = {}
    for path in (ROUTER / "pkg").rglob("*.go"):
        for t in re.findall(r'\w*Type\s*=\s*"([a-z0-9-]+)"', path.read_text()):
            out[t] = path.read_text()
    return out


def epp_problems(config: Mapping[str, Any]) -> list[str]:
    """What llm-d-router v0.10.0's loader would refuse (pkg/epp/config/loader: a strict decoder
    for the file and for every plugin's parameters; validation.go's reference rules)."""
    problems = []
    doc = _go(ROUTER / "apix" / "config" / "v1alpha1" / "doc.go")
    group = re.search(r"\+groupName=(\S+)", doc)
    if group is None or config.get("apiVersion") != f"{group[1]}/v1alpha1":
        problems.append(f"apiVersion {config.get('apiVersion')}")
    if config.get("kind") != "EndpointPickerConfig":
        problems.append(f"kind {config.get('kind')}")
    top = {k: v for k, v in config.items() if k not in ("apiVersion", "kind")}
    shape = {k: v for k, v in top.items() if k != "plugins"} | {
        "plugins": [{k: v for k, v in p.items() if k != "parameters"} for p in top.get("plugins", [])]
    }
    config_types = _go(ROUTER / "apix" / "config" / "v1alpha1" / "endpointpickerconfig_types.go")
    problems += unknown_keys(shape, _tags(config_types, "json"))
    sources = _plugin_sources()
    names: list[str] = []
    for i, plugin in enumerate(config.get("plugins", [])):
        names.append(plugin.get("name") or plugin["type"])  # the loader's default: the type
        if plugin["type"] not in sources:
            problems.append(f"plugins[{i}].type {plugin['type']} is not a v0.10.0 plugin")
            continue
        known = _tags(sources[plugin["type"]], "json")
        problems += unknown_keys(plugin.get("parameters") or {}, known, f"plugins[{i}].parameters")
    problems += [f"duplicate plugin name {n}" for n in sorted({n for n in names if names.count(n) > 1})]
    layer = config.get("dataLayer") or {}
    refs = [p["pluginRef"] for s in layer.get("sources", []) for p in [s, *s.get("extractors", [])]]
    refs += [p["pluginRef"] for prof in config.get("schedulingProfiles", []) for p in prof["plugins"]]
    problems += [f"pluginRef {r} names no plugin" for r in refs if r not in names]
    return problems


def test_the_keda_trigger_uses_keys_the_prometheus_scaler_reads() -> None:
    doc = one(SCALED_OBJECT, "ScaledObject")
    assert keda_problems(doc) == []
    wrong = copy.deepcopy(doc)
    meta = wrong["spec"]["triggers"][0]["metadata"]
    meta["treshold"] = meta.pop("threshold")
    assert keda_problems(wrong) == ["triggers[0].metadata.treshold"]


def test_the_adapter_rule_uses_prometheus_adapters_fields() -> None:
    config = adapter_config()
    assert adapter_problems(config) == []
    assert [r["seriesQuery"] for r in config["externalRules"]]
    wrong = copy.deepcopy(config)
    wrong["externalRules"][0]["metricQuery"] = wrong["externalRules"][0].pop("metricsQuery")
    assert adapter_problems(wrong) == [".externalRules[0].metricQuery"]


def test_the_epp_config_uses_llm_d_routers_plugins_and_fields() -> None:
    config = epp_config()
    assert epp_problems(config) == []
    types = {p["type"] for p in config["plugins"]}
    assert {"endpoint-attribute-scorer", "metrics-data-source", "core-metrics-extractor"} <= types
    # and the check can fail: a misspelt parameter, an unknown plugin, a dangling reference
    wrong = copy.deepcopy(config)
    scorer = next(p for p in wrong["plugins"] if p["type"] == "endpoint-attribute-scorer")
    scorer["parameters"]["attributeKy"] = scorer["parameters"].pop("attributeKey")
    wrong["plugins"].append({"type": "kv-free-tokens-scorer"})
    wrong["schedulingProfiles"][0]["plugins"][0]["pluginRef"] = "rankguard-kv-free"
    assert epp_problems(wrong) == [
        f"plugins[{wrong['plugins'].index(scorer)}].parameters.attributeKy",
        f"plugins[{len(wrong['plugins']) - 1}].type kv-free-tokens-scorer is not a v0.10.0 plugin",
        "pluginRef rankguard-kv-free names no plugin",
    ]


# --------------------------------------------------------------------------------------------
# rankguard's own side: the rules, the pods, the agent's metric


def test_the_scalers_read_the_charts_recording_rules() -> None:
    recorded = {
        r["record"]
        for path in (REPO / "charts" / "rankguard" / "files").glob("*.yaml")
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", [])
        for r in group["rules"]
        if "record" in r
    }
    keda = one(SCALED_OBJECT, "ScaledObject")["spec"]["triggers"][0]["metadata"]["query"]
    hpa = one(HPA, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["external"]["metric"]["name"]
    adapter = [r["seriesQuery"] for r in adapter_config()["externalRules"]]
    read = set(RULE_NAME.findall(keda)) | {hpa} | {n for q in adapter for n in RULE_NAME.findall(q)}
    assert read == {"rankguard:llmservice_demand_replicas"}
    assert read <= recorded, f"not recorded by the chart: {read - recorded}"
    # the selector labels are the rule's (namespace, llmservice) and name the target service
    target = one(SCALED_OBJECT, "ScaledObject")["spec"]["scaleTargetRef"]["name"]
    assert f'llmservice="{target}"' in keda
    assert one(HPA, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["external"]["metric"]["selector"] == {
        "matchLabels": {"llmservice": target}
    }


def _serving_template(doc: Mapping[str, Any], namespace: str) -> dict[str, Any]:
    objects, refusals = render_service(
        doc, namespace=namespace, agent_image="agent:test", gpu_memory_bytes=80 * 2**30
    )
    assert refusals == []
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    return dict(deployment["spec"]["template"])


def _port(template: Mapping[str, Any], name: str) -> int:
    ports = [p for c in template["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, ports
    return int(ports[0]["containerPort"])


def test_the_inference_pool_selects_the_pods_that_serve_http() -> None:
    [service] = [d for d in documents(SERVICE_EXAMPLE) if d["kind"] == "LLMService"]
    pool = one(POOL_EPP, "InferencePool")
    for target in (one(SCALED_OBJECT, "ScaledObject"), one(HPA, "HorizontalPodAutoscaler")):
        assert target["spec"]["scaleTargetRef"] == {
            "apiVersion": service["apiVersion"],
            "kind": service["kind"],
            "name": service["metadata"]["name"],
        }
    template = _serving_template(service, "llm")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= template["metadata"]["labels"].items(), template["metadata"]["labels"]
    # not every vLLM pod rankguard runs: another LLMService's pods are left out
    other = copy.deepcopy(service)
    other["metadata"]["name"] = "another"
    assert not selector.items() <= _serving_template(other, "llm")["metadata"]["labels"].items()
    # vLLM's port for requests; the agent's for the second metrics source
    assert pool["spec"]["targetPorts"] == [{"number": _port(template, "http")}]
    [agent_source] = [p for p in epp_config()["plugins"] if p.get("name") == "rankguard-agent-metrics"]
    assert agent_source["parameters"]["port"] == _port(template, "agent")


def test_the_epp_scores_a_metric_the_agent_serves() -> None:
    served = {m.name for m in capacity_series(100_000, 0.25, {}, [], [])}
    [extractor] = [p for p in epp_config()["plugins"] if p.get("name") == "rankguard-agent-extractor"]
    [engine] = extractor["parameters"]["engineConfigs"]
    [custom] = engine["customMetrics"]
    assert custom["metricSpec"] in served, served
    [scorer] = [p for p in epp_config()["plugins"] if p["type"] == "endpoint-attribute-scorer"]
    assert scorer["parameters"]["attributeKey"] == custom["attributeKey"]


def test_a_multi_node_pool_needs_the_leader_role_the_example_names() -> None:
    """A multi-node service's workers carry the same service labels but serve no HTTP: the pool
    must add rankguard.io/role: leader (the example's comment), which selects the leaders only."""
    [service] = [copy.deepcopy(d) for d in documents(SERVICE_EXAMPLE) if d["kind"] == "LLMService"]
    service["spec"]["distributed"] = {"podsPerGroup": 2, "workload": "StatefulSet"}
    objects, refusals = render_service(
        service, namespace="llm", agent_image="agent:test", gpu_memory_bytes=80 * 2**30
    )
    assert refusals == []
    sets = [o for o in objects if o["kind"] == "StatefulSet"]
    templates = {o["spec"]["template"]["metadata"]["labels"][ROLE_LABEL]: o["spec"]["template"] for o in sets}
    assert set(templates) == {"leader", "worker"}
    selector = one(POOL_EPP, "InferencePool")["spec"]["selector"]["matchLabels"]
    assert f"{ROLE_LABEL}: leader" in POOL_EPP.read_text()
    leaders = selector | {ROLE_LABEL: "leader"}
    assert all(selector.items() <= t["metadata"]["labels"].items() for t in templates.values())
    assert leaders.items() <= templates["leader"]["metadata"]["labels"].items()
    assert not leaders.items() <= templates["worker"]["metadata"]["labels"].items()
    assert (
        _port(templates["leader"], "http")
        == one(POOL_EPP, "InferencePool")["spec"]["targetPorts"][0]["number"]
    )


def test_the_scalers_target_a_kind_with_a_scale_subresource() -> None:
    crd = yaml.safe_load((REPO / "crds" / "llmservice.yaml").read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["storage"]]
    for path, kind in ((SCALED_OBJECT, "ScaledObject"), (HPA, "HorizontalPodAutoscaler")):
        ref = one(path, kind)["spec"]["scaleTargetRef"]
        assert ref["apiVersion"] == f"{crd['spec']['group']}/{version['name']}"
        assert ref["kind"] == crd["spec"]["names"]["kind"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
