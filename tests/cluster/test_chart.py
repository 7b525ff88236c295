"""The Helm chart against real Helm and a real API server: the install shapes and permissions.

(Over 450 lines because every install shape shares one installed-chart harness and the one
table of the operator's documented permissions; split, each part would rebuild both. The
helpers here are shared by the other chart modules: test_chart_values.py (the operator pod's
values), test_chart_crds.py (the CRD template), test_chart_monitoring.py (monitoring, helm test).)

- `helm lint --strict` and `helm template` are clean for every install shape (Helm's own
  schema validation, and the chart's refusals of contradictions: test_chart_values.py).
- the rendered manifests pass the API server's validation (server-side dry run).
- installed into a namespace that enforces the "restricted" Pod Security Standard, the
  operator's Pod is admitted, a non-compliant pod is refused there, and the operator's
  ServiceAccount can do exactly the documented set (docs/rbac.md) and nothing more.
- a namespaced install grants nothing outside the watched namespaces.
- `helm uninstall` removes every operator object and leaves the CRD.

No test here needs a node: a Pod object is created (and admitted) without one. Every install
carries a nodeSelector no node matches, so a node some other test registers never runs it.
The session's CRD is installed first (`crd`), as on a cluster upgraded from an older chart:
these releases leave it alone (test_chart_crds.py has a cluster of its own for the CRD's life).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_sim.kube import testbin
from rankguard_sim.kube.cluster import K8S_VERSION, ControlPlane
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rankguard"
CRD_NAME = "llmservices.rankguard.io"
NO_NODE = ["--set-string", "nodeSelector.rankguard\\.io/test-no-such-node=true"]

# docs/rbac.md, as `kubectl auth can-i --list` names resources: (resource[.group][/subresource], verb).
DOCUMENTED: frozenset[tuple[str, str]] = frozenset(
    [("llmservices.rankguard.io", v) for v in ("get", "list", "watch", "patch")]
    + [("llmservices.rankguard.io/status", v) for v in ("get", "patch")]
    + [("deployments.apps", v) for v in ("get", "list", "watch", "create", "patch", "delete")]
    + [("statefulsets.apps", v) for v in ("get", "list", "watch", "create", "patch", "delete")]
    + [("leaderworkersets.leaderworkerset.x-k8s.io", v) for v in ("get", "create", "patch", "delete")]
    + [("services", v) for v in ("get", "list", "watch", "create", "patch", "delete")]
    + [("pods", v) for v in ("get", "list", "watch")]
    + [("replicasets.apps", v) for v in ("get", "list", "watch")]
    + [("configmaps", "get")]
    + [("persistentvolumeclaims", v) for v in ("get", "create", "patch")]
    + [("events", v) for v in ("create", "patch", "list")]
    + [("events.events.k8s.io", v) for v in ("create", "patch")]
)
# docs/rbac.md, "Cluster-wide installs only": what the ClusterRole adds (cluster-scoped objects).
CLUSTER_WIDE: frozenset[tuple[str, str]] = DOCUMENTED | {("nodes", "get")}


def leader_election(lease: str) -> frozenset[tuple[str, str]]:
    """docs/rbac.md, "Leader election", in the release namespace: create any Lease, get and
    update only the one named `lease`."""
    return frozenset(
        [("leases.coordination.k8s.io", "create")]
        + [(f"leases.coordination.k8s.io[{lease}]", v) for v in ("get", "update")]
    )


# Value sets covering every shape of the chart (cluster-wide, namespaced, every option on).
SHAPES: dict[str, list[str]] = {
    "default": [],
    "namespaced": ["--set", "rbac.namespaced=true"],
    "watch-list": ["--set", "watchNamespaces={team-a,team-b}"],
    "no-leader-election": ["--set", "leaderElection.enabled=false"],
    "everything-on": [
        "--set",
        "replicaCount=2,podDisruptionBudget.enabled=true,commonLabels.team=ml,crds.keep=false",
        "--set",
        "metrics.prometheusRule.enabled=true,metrics.dashboard.enabled=true,agentPodMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true,networkPolicy.allowMonitoring.enabled=true",
        "--set",
        "networkPolicy.enabled=true,networkPolicy.namespaces={team-a},operator.logLevel=debug",
        "--set",
        "image.digest=sha256:" + "a" * 64,
        "--set",
        "podSecurityContext.runAsUser=null",
        "--set-json",
        'tolerations=[{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]',
        "--set-json",
        'extraEnv=[{"name": "RANKGUARD_SCRAPE_INTERVAL", "value": "10"}]',
        "--set-json",
        'extraVolumes=[{"name": "ca", "configMap": {"name": "ca"}}]',
        "--set-json",
        'extraVolumeMounts=[{"name": "ca", "mountPath": "/etc/ca", "readOnly": true}]',
        "--set-json",
        'topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "zone",'
        ' "whenUnsatisfiable": "DoNotSchedule"}]',
    ],
}


# --------------------------------------------------------------------------- helpers
def helm_bin() -> str:
    return str(testbin.testbin_dir() / "helm")


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([helm_bin(), *args], capture_output=True, text=True, timeout=120, check=False)
    if check and r.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({r.returncode}):\n{r.stderr}")
    return r


def unexpected_stderr(stderr: str) -> list[str]:
    """stderr lines other than Helm's notice that it followed the CRD link (which it must)."""
    return [
        line
        for line in stderr.splitlines()
        if line.strip()
        and not (
            "found symbolic link in path" in line
            and line.rstrip().endswith("Contents of linked file included and used")
            and "charts/rankguard/crd-source/llmservice.yaml" in line
        )
    ]


def template(
    *args: str, release: str = "rg", chart: Path = CHART, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """`helm template RELEASE CHART ARGS`. hack/testbin's helm, built from source without Helm's
    release flags, assumes Kubernetes v1.20 (below the chart's kubeVersion), so say which one."""
    return run_helm("template", release, str(chart), f"--kube-version={K8S_VERSION}", *args, check=check)


def render(namespace: str, *values: str, release: str = "rg", chart: Path = CHART) -> list[dict[str, Any]]:
    r = template("-n", namespace, *values, release=release, chart=chart)
    assert unexpected_stderr(r.stderr) == [], r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    """A container's env by name: the value, or the valueFrom of a downward-API variable."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def can_i_list(cluster: ControlPlane, namespace: str, account: str) -> set[tuple[str, str]]:
    """`kubectl auth can-i --list` for a ServiceAccount, as (resource-or-URL, verb) pairs.

    The table has fixed-width columns (Resources, Non-Resource URLs, Resource Names, Verbs);
    the header gives their offsets. A rule limited to resource names is kept apart
    ("pods[name]"), so it can never pass for a grant on every object.
    """
    out = cluster.kubectl(
        "auth", "can-i", "--list", "-n", namespace, f"--as=system:serviceaccount:{account}"
    ).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    header = lines[0]
    cols = [header.index(h) for h in ("Resources", "Non-Resource URLs", "Resource Names", "Verbs")]
    assert cols == sorted(cols), header
    pairs: set[tuple[str, str]] = set()
    for line in lines[1:]:
        cells = [line[a:b].strip() for a, b in zip(cols, [*cols[1:], len(line) + 1], strict=True)]
        resource, urls, names, verbs = cells
        subject = resource or urls
        if names not in ("", "[]"):
            subject = f"{resource}{names}"
        for verb in verbs.strip("[]").split():
            pairs.add((subject, verb))
    return pairs


@dataclass
class Release:
    name: str
    namespace: str
    fullname: str


def helm_install(cluster: ControlPlane, release: str, namespace: str, *values: str) -> Release:
    r = cluster.helm("install", release, str(CHART), "-n", namespace, *NO_NODE, *values, check=False)
    assert r.returncode == 0, r.stderr
    assert unexpected_stderr(r.stderr) == [], r.stderr
    return Release(release, namespace, f"{release}-rankguard")


def helm_uninstall(cluster: ControlPlane, rel: Release) -> None:
    r = cluster.helm("uninstall", rel.name, "-n", rel.namespace, "--wait", "--timeout=60s", check=False)
    assert r.returncode == 0 or "not found" in r.stderr, r.stderr


def make_namespace(core: client.CoreV1Api, prefix: str, labels: dict[str, str] | None = None) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(
        {"metadata": {"name": name, "labels": {"rankguard.io/test": "true", **(labels or {})}}}
    )
    return name


RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}


def dry_run_create_pod(
    cluster: ControlPlane, namespace: str, spec: dict[str, Any]
) -> subprocess.CompletedProcess[str]:
    """Create a pod of `spec` in `namespace`, dry run: admission (Pod Security) judges it."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "dry-run", "namespace": namespace},
        "spec": spec,
    }
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)


def delete_namespace(core: client.CoreV1Api, name: str) -> None:
    try:
        core.delete_namespace(name)
    except ApiException as e:
        if e.status != 404:
            raise


# --------------------------------------------------------------------------- helm only
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_helm_lint_strict_and_template_are_clean(shape: str) -> None:
    r = run_helm("lint", "--strict", str(CHART), "-n", "ops", *SHAPES[shape], check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[WARNING]" not in r.stdout and "[ERROR]" not in r.stdout, r.stdout
    assert unexpected_stderr(r.stderr) == [], r.stderr
    docs = render("ops", *SHAPES[shape])
    assert {"ServiceAccount", "Deployment"} <= {d["kind"] for d in docs}


def test_deployment_is_one_hardened_replica_probed_on_kopfs_healthz() -> None:
    (deploy,) = by_kind(render("ops"), "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1
    # Leader election is on by default: the new pod starts first, as a standby.
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is True
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = env_of(c)
    assert ports == {
        "health": int(env["RANKGUARD_LIVENESS_PORT"]),
        "metrics": int(env["RANKGUARD_METRICS_PORT"]),
    }
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert set(env) == {
        "RANKGUARD_WATCH_NAMESPACES",
        "RANKGUARD_AGENT_IMAGE",
        "RANKGUARD_LIVENESS_PORT",
        "RANKGUARD_METRICS_PORT",
        "RANKGUARD_LOG_FORMAT",
        "RANKGUARD_LOG_LEVEL",
        "RANKGUARD_LEADER_ELECTION",
        "RANKGUARD_LEASE_NAME",
        "RANKGUARD_LEASE_NAMESPACE",
        "RANKGUARD_POD_NAME",
    }
    assert env["RANKGUARD_WATCH_NAMESPACES"] == ""  # every namespace
    assert env["RANKGUARD_LOG_LEVEL"] == "info"
    assert env["RANKGUARD_AGENT_IMAGE"].startswith("ghcr.io/rankguard/agent:")
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])


def test_image_digest_wins_over_tag_and_empty_tag_means_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    digest = "sha256:" + "b" * 64
    (deploy,) = by_kind(render("ops", "--set", f"agentImage.digest={digest}"), "Deployment")
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    env = env_of(c)
    assert env["RANKGUARD_AGENT_IMAGE"] == f"ghcr.io/rankguard/agent@{digest}"
    assert c["image"] == f"ghcr.io/rankguard/operator:{chart['appVersion']}"


def test_namespaced_install_renders_roles_and_bindings_only() -> None:
    for values, namespaces in (
        (["--set", "rbac.namespaced=true"], ["ops"]),
        (["--set", "watchNamespaces={team-a,team-b}"], ["team-a", "team-b"]),
    ):
        docs = render("ops", *values)
        kinds = {d["kind"] for d in docs}
        assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
        # The reconciling Roles (the leader-election one is test_chart_values.py's).
        roles, bindings = (
            [r for r in by_kind(docs, kind) if r["metadata"]["name"] == "rg-rankguard"]
            for kind in ("Role", "RoleBinding")
        )
        assert sorted(r["metadata"]["namespace"] for r in roles) == namespaces
        assert sorted(b["metadata"]["namespace"] for b in bindings) == namespaces
        for b in bindings:
            assert b["subjects"] == [{"kind": "ServiceAccount", "name": "rg-rankguard", "namespace": "ops"}]
            assert b["roleRef"]["kind"] == "Role"
        (deploy,) = by_kind(docs, "Deployment")
        env = env_of(deploy["spec"]["template"]["spec"]["containers"][0])
        assert env["RANKGUARD_WATCH_NAMESPACES"] == ",".join(namespaces)
    # The same rules, whichever the scope; the ClusterRole adds only what a Role cannot grant.
    (cluster_role,) = by_kind(render("ops"), "ClusterRole")
    for role in roles:
        assert cluster_role["rules"][: len(role["rules"])] == role["rules"]
        assert cluster_role["rules"][len(role["rules"]) :] == [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}
        ]


def test_network_policy_admits_only_the_operator_to_the_agent_port() -> None:
    docs = render(
        "ops",
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "watchNamespaces={team-a,team-b}",
    )
    policies = by_kind(docs, "NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    (deploy,) = by_kind(docs, "Deployment")
    operator_labels = deploy["spec"]["selector"]["matchLabels"]
    for p in policies:
        spec = p["spec"]
        assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "rankguard"}}
        assert spec["policyTypes"] == ["Ingress"]
        agent_rule, serving_rule = spec["ingress"]
        assert agent_rule["ports"] == [{"port": "agent", "protocol": "TCP"}]
        assert agent_rule["from"] == [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ops"}},
                "podSelector": {"matchLabels": operator_labels},
            }
        ]
        # Selecting the serving pods isolates them: vLLM's port must stay open to everyone.
        assert serving_rule == {"ports": [{"port": "http", "protocol": "TCP"}]}
    # The operator's own pod is not a serving pod.
    assert deploy["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/managed-by"] != "rankguard"


def test_service_monitor_scrapes_the_metrics_service() -> None:
    docs = render(
        "ops", "--set", "metrics.serviceMonitor.enabled=true,metrics.serviceMonitor.labels.release=kps"
    )
    (svc,) = by_kind(docs, "Service")
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kps"
    selected = sm["spec"]["selector"]["matchLabels"]
    assert selected.items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"] == "metrics"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["ops"]}
    assert by_kind(render("ops"), "ServiceMonitor") == []  # off by default


# --------------------------------------------------------------------------- real API server
def dry_run_apply(cluster: ControlPlane, docs: list[dict[str, Any]]) -> None:
    """Server-side apply, dry run: every object passes the API server's validation."""
    r = cluster.kubectl(
        "apply",
        "--server-side",
        "--dry-run=server",
        "--field-manager=rankguard-tests",
        "-f",
        "-",
        input=yaml.safe_dump_all(docs),
        check=False,
    )
    assert r.returncode == 0, r.stderr
    applied = [line for line in r.stdout.splitlines() if "serverside-applied (server dry run)" in line]
    assert len(applied) == len(docs), r.stdout


def test_rendered_manifests_pass_server_side_dry_run(cluster: ControlPlane, crd: str, namespace: str) -> None:
    # Every kind the chart renders without the prometheus-operator's CRDs (the monitoring
    # objects pass in test_chart_monitoring.py, which installs them).
    for values in (
        ["--set", f"networkPolicy.enabled=true,networkPolicy.namespaces={{{namespace}}}"],
        ["--set", "rbac.namespaced=true,leaderElection.enabled=false"],
        ["--set", "replicaCount=3,podDisruptionBudget.enabled=true,commonLabels.team=ml"],
    ):
        dry_run_apply(cluster, render(namespace, *NO_NODE, *values))


@pytest.fixture(scope="module")
def restricted_release(cluster: ControlPlane, api: client.ApiClient, crd: str) -> Iterator[Release]:
    """The chart installed, as a platform team would, into a namespace enforcing "restricted"."""
    core = client.CoreV1Api(api)
    ns = make_namespace(core, "t-chart-restricted", RESTRICTED)
    rel = Release("rgr", ns, "rgr-rankguard")
    try:
        rel = helm_install(cluster, "rgr", ns)
        yield rel
    finally:
        helm_uninstall(cluster, rel)
        delete_namespace(core, ns)


def operator_pod_spec(cluster: ControlPlane, rel: Release) -> dict[str, Any]:
    out = cluster.kubectl("get", "deployment", rel.fullname, "-n", rel.namespace, "-o", "json").stdout
    spec = json.loads(out)["spec"]["template"]["spec"]
    assert isinstance(spec, dict)
    return spec


def test_restricted_namespace_admits_the_operator_pod(
    cluster: ControlPlane, api: client.ApiClient, restricted_release: Release
) -> None:
    rel = restricted_release
    core = client.CoreV1Api(api)
    # The ReplicaSet controller creates the Pod; Pod Security admission judges that create.
    pods = wait_for(
        "the operator's Pod to be created (admitted by Pod Security)",
        lambda: (
            core.list_namespaced_pod(
                rel.namespace, label_selector=f"app.kubernetes.io/instance={rel.name}"
            ).items
        ),
    )
    assert len(pods) == 1
    assert pods[0].spec.service_account_name == rel.fullname
    apps = client.AppsV1Api(api)
    (rs,) = apps.list_namespaced_replica_set(
        rel.namespace, label_selector=f"app.kubernetes.io/instance={rel.name}"
    ).items
    assert not [c for c in rs.status.conditions or [] if c.type == "ReplicaFailure"]


def test_restricted_namespace_accepts_the_rendered_pod_and_refuses_a_weaker_one(
    cluster: ControlPlane, restricted_release: Release
) -> None:
    rel = restricted_release

    spec = operator_pod_spec(cluster, rel)
    ok = dry_run_create_pod(cluster, rel.namespace, spec)
    assert ok.returncode == 0, ok.stderr
    # The same pod with privilege escalation allowed and no seccomp profile: must be refused,
    # or the check above proves nothing.
    weaker = json.loads(json.dumps(spec))
    weaker["securityContext"].pop("seccompProfile")
    for c in weaker["containers"]:
        c["securityContext"]["allowPrivilegeEscalation"] = True
        c["securityContext"].pop("seccompProfile")
    refused = dry_run_create_pod(cluster, rel.namespace, weaker)
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
    assert "allowPrivilegeEscalation" in refused.stderr and "seccompProfile" in refused.stderr


def test_notes_name_this_release_and_the_next_steps(
    cluster: ControlPlane, restricted_release: Release
) -> None:
    rel = restricted_release
    notes = cluster.helm("get", "notes", rel.name, "-n", rel.namespace).stdout
    assert f"rollout status deployment/{rel.fullname}" in notes
    assert "apply -f examples/llama3-70b-tp4.yaml" in notes
    assert "get llmservice --watch" in notes
    assert f'every namespace (ClusterRole "{rel.fullname}")' in notes


def test_operator_account_can_do_exactly_the_documented_set(
    cluster: ControlPlane, api: client.ApiClient, restricted_release: Release
) -> None:
    rel = restricted_release
    core = client.CoreV1Api(api)
    # What every authenticated account may do (self-reviews, discovery URLs): measured here,
    # from an account with no bindings, so a new Kubernetes default cannot break the test.
    core.create_namespaced_service_account(rel.namespace, {"metadata": {"name": "no-bindings"}})
    # Cluster-wide: the same grants in any namespace, and the one Lease in its own.
    for ns, documented in (
        (rel.namespace, CLUSTER_WIDE | leader_election(rel.fullname)),
        ("default", CLUSTER_WIDE),
    ):
        baseline = can_i_list(cluster, ns, f"{rel.namespace}:no-bindings")
        granted = can_i_list(cluster, ns, f"{rel.namespace}:{rel.fullname}")
        assert baseline <= granted
        assert granted - baseline == documented, (
            f"in {ns}: more than documented: {sorted(granted - baseline - documented)}; "
            f"missing: {sorted(documented - (granted - baseline))}"
        )


def test_namespaced_install_grants_nothing_outside_the_watched_namespace(
    cluster: ControlPlane, api: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api)
    watched = make_namespace(core, "t-chart-watched")
    rel = Release("rgn", namespace, "rgn-rankguard")
    try:
        rel = helm_install(cluster, "rgn", namespace, "--set", f"watchNamespaces={{{watched}}}")
        core.create_namespaced_service_account(namespace, {"metadata": {"name": "no-bindings"}})
        baseline = can_i_list(cluster, watched, f"{namespace}:no-bindings")
        assert can_i_list(cluster, watched, f"{namespace}:{rel.fullname}") - baseline == DOCUMENTED
        # In its own namespace, which it does not watch, only the Lease; elsewhere nothing.
        for elsewhere, documented in ((namespace, leader_election(rel.fullname)), ("default", frozenset())):
            baseline = can_i_list(cluster, elsewhere, f"{namespace}:no-bindings")
            assert can_i_list(cluster, elsewhere, f"{namespace}:{rel.fullname}") - baseline == documented
        rbac = client.RbacAuthorizationV1Api(api)
        selector = f"app.kubernetes.io/instance={rel.name}"
        assert rbac.list_cluster_role(label_selector=selector).items == []
        assert rbac.list_cluster_role_binding(label_selector=selector).items == []
    finally:
        helm_uninstall(cluster, rel)
        delete_namespace(core, watched)


def test_helm_uninstall_removes_the_operator_and_keeps_the_crd(
    cluster: ControlPlane, api: client.ApiClient, crd: str, namespace: str
) -> None:
    rel = helm_install(
        cluster,
        "rgu",
        namespace,
        "--set",
        f"networkPolicy.enabled=true,networkPolicy.namespaces={{{namespace}}}",
    )
    selector = f"app.kubernetes.io/instance={rel.name}"
    core, apps, rbac = client.CoreV1Api(api), client.AppsV1Api(api), client.RbacAuthorizationV1Api(api)
    net, ext = client.NetworkingV1Api(api), client.ApiextensionsV1Api(api)

    def operator_objects() -> dict[str, list[str]]:
        def names(items: list[Any]) -> list[str]:
            return sorted(i.metadata.name for i in items)

        return {
            "deployments": names(apps.list_namespaced_deployment(namespace, label_selector=selector).items),
            "serviceaccounts": names(
                core.list_namespaced_service_account(namespace, label_selector=selector).items
            ),
            "services": names(core.list_namespaced_service(namespace, label_selector=selector).items),
            "roles": names(rbac.list_role_for_all_namespaces(label_selector=selector).items),
            "rolebindings": names(rbac.list_role_binding_for_all_namespaces(label_selector=selector).items),
            "clusterroles": names(rbac.list_cluster_role(label_selector=selector).items),
            "clusterrolebindings": names(rbac.list_cluster_role_binding(label_selector=selector).items),
            "networkpolicies": names(
                net.list_namespaced_network_policy(namespace, label_selector=selector).items
            ),
        }

    installed = operator_objects()
    assert installed["deployments"] == [rel.fullname]
    assert installed["serviceaccounts"] == [rel.fullname]
    assert installed["services"] == [f"{rel.fullname}-metrics"]
    assert installed["clusterroles"] == installed["clusterrolebindings"] == [rel.fullname]
    assert installed["roles"] == installed["rolebindings"] == [f"{rel.fullname}-leader-election"]
    assert installed["networkpolicies"] == [f"{rel.fullname}-agent"]
    assert ext.read_custom_resource_definition(CRD_NAME).metadata.name == CRD_NAME

    helm_uninstall(cluster, rel)
    assert operator_objects() == {kind: [] for kind in installed}
    # The CRD was there before (the session's), so this release never owned it: it stays, and
    # LLMServices (and their serving pods) survive. test_chart_crds.py: a CRD the release owns.
    assert ext.read_custom_resource_definition(CRD_NAME).metadata.deletion_timestamp is None
