"""The Helm chart against real Helm and a real API server.

(Over 450 lines because every install shape shares one installed-chart harness and the one
table of the operator's documented permissions; split, each part would rebuild both.)

- `helm lint --strict` and `helm template` are clean for every install shape; Helm's own
  schema validation refuses unknown and mistyped values.
- the chart's CRD is crds/llmservice.yaml, in `helm template --include-crds`, `helm show crds`
  and the packaged archive.
- the rendered manifests pass the API server's validation (server-side dry run).
- installed into a namespace that enforces the "restricted" Pod Security Standard, the
  operator's Pod is admitted, a non-compliant pod is refused there, and the operator's
  ServiceAccount can do exactly the documented set (docs/rbac.md) and nothing more.
- a namespaced install grants nothing outside the watched namespaces.
- `helm uninstall` removes every operator object and leaves the CRD.

No test here needs a node: a Pod object is created (and admitted) without one. Every install
carries a nodeSelector no node matches, so a node some other test registers never runs it.

(Over 450 lines because every check shares one installed Helm and API server, and the table of
install shapes and the documented permissions they must grant, kept in one place.)
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_sim import testbin
from rankguard_sim.cluster import K8S_VERSION, ControlPlane
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rankguard"
CRD_FILE = REPO / "crds" / "llmservice.yaml"
CRD_NAME = "llmservices.rankguard.io"
NO_NODE = ["--set-string", "nodeSelector.rankguard\\.io/test-no-such-node=true"]

# docs/rbac.md, as `kubectl auth can-i --list` names resources: (resource[.group][/subresource], verb).
DOCUMENTED: frozenset[tuple[str, str]] = frozenset(
    [("llmservices.rankguard.io", v) for v in ("get", "list", "watch", "patch")]
    + [("llmservices.rankguard.io/status", v) for v in ("get", "patch")]
    + [("deployments.apps", v) for v in ("get", "list", "watch", "create", "patch")]
    + [("services", v) for v in ("get", "list", "watch", "create", "patch")]
    + [("pods", v) for v in ("get", "list", "watch")]
    + [("replicasets.apps", v) for v in ("get", "list", "watch")]
    + [("configmaps", "get")]
    + [("persistentvolumeclaims", v) for v in ("get", "create", "patch")]
    + [("events", v) for v in ("create", "patch")]
    + [("events.events.k8s.io", v) for v in ("create", "patch")]
)
# docs/rbac.md, "Cluster-wide installs only": what the ClusterRole adds (cluster-scoped objects).
CLUSTER_WIDE: frozenset[tuple[str, str]] = DOCUMENTED | {("nodes", "get")}

# Value sets covering every shape of the chart (cluster-wide, namespaced, every option on).
SHAPES: dict[str, list[str]] = {
    "default": [],
    "namespaced": ["--set", "rbac.namespaced=true"],
    "watch-list": ["--set", "watchNamespaces={team-a,team-b}"],
    "everything-on": [
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "networkPolicy.enabled=true",
        "--set",
        "networkPolicy.namespaces={team-a}",
        "--set",
        "image.digest=sha256:" + "a" * 64,
        "--set",
        "podSecurityContext.runAsUser=null",
        "--set",
        "tolerations[0].key=dedicated,tolerations[0].operator=Exists,tolerations[0].effect=NoSchedule",
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
            and "charts/rankguard/crds/llmservice.yaml" in line
        )
    ]


def render(namespace: str, *values: str, release: str = "rg", crds: bool = False) -> list[dict[str, Any]]:
    # A source-built helm knows no cluster version, so say which one we target.
    args = ["template", release, str(CHART), "-n", namespace, f"--kube-version={K8S_VERSION}", *values]
    r = run_helm(*args, *(["--include-crds"] if crds else []))
    assert unexpected_stderr(r.stderr) == [], r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


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


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (["--set", "image.tga=1.0"], "tga"),  # a misspelt key is refused, not ignored
        (["--set", "networkPolicy.agentPortNmae=agent"], "agentPortNmae"),
        (["--set-string", "operator.metricsPort=9090"], "metricsPort"),  # a string, not an integer
        (["--set", "rbac.namespaced=yes-please"], "namespaced"),
        (["--set", "operator.logFormat=xml"], "logFormat"),
        (["--set", "podSecurityContext.runAsUser=0"], "runAsUser"),  # root is not an option
        (["--set", "watchNamespaces={Team_A}"], "watchNamespaces"),
    ],
)
def test_schema_refuses_unknown_and_mistyped_values(values: list[str], complaint: str) -> None:
    r = run_helm("template", "rg", str(CHART), f"--kube-version={K8S_VERSION}", *values, check=False)
    assert r.returncode != 0, f"helm accepted {values}"
    assert "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert complaint in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (["--set", "networkPolicy.enabled=true"], "needs networkPolicy.namespaces"),
        (["--set", "serviceAccount.create=false"], "needs serviceAccount.name"),
        (["--set", "metrics.serviceMonitor.enabled=true,metrics.service.enabled=false"], "needs metrics"),
    ],
)
def test_contradictory_values_fail_with_a_message_that_says_what_to_set(
    values: list[str], complaint: str
) -> None:
    r = run_helm("template", "rg", str(CHART), f"--kube-version={K8S_VERSION}", *values, check=False)
    assert r.returncode != 0
    assert complaint in r.stderr, r.stderr


def test_the_chart_ships_crds_llmservice_yaml_unchanged(tmp_path: Path) -> None:
    source = CRD_FILE.read_bytes()
    crds = [d for d in render("ops", crds=True) if d["kind"] == "CustomResourceDefinition"]
    assert crds == [yaml.safe_load(source)]
    assert by_kind(render("ops"), "CustomResourceDefinition") == []  # never a template
    shown = run_helm("show", "crds", str(CHART))
    assert shown.stdout.strip() == source.decode().strip()
    # The packaged archive holds the file itself, not a link a user's machine cannot resolve.
    run_helm("package", str(CHART), "-d", str(tmp_path))
    (archive,) = tmp_path.glob("rankguard-*.tgz")
    with tarfile.open(archive) as tar:
        member = tar.getmember("rankguard/crds/llmservice.yaml")
        assert member.isfile()
        extracted = tar.extractfile(member)
        assert extracted is not None
        assert extracted.read() == source


def test_deployment_is_one_recreated_hardened_replica_probed_on_kopfs_healthz() -> None:
    (deploy,) = by_kind(render("ops"), "Deployment")
    spec = deploy["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
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
    env = {e["name"]: e["value"] for e in c["env"]}
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
    }
    assert env["RANKGUARD_WATCH_NAMESPACES"] == ""  # every namespace
    assert env["RANKGUARD_AGENT_IMAGE"].startswith("ghcr.io/rankguard/agent:")
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert any(v["name"] == "tmp" and "emptyDir" in v for v in pod["volumes"])


def test_image_digest_wins_over_tag_and_empty_tag_means_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    digest = "sha256:" + "b" * 64
    (deploy,) = by_kind(render("ops", "--set", f"agentImage.digest={digest}"), "Deployment")
    c = deploy["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
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
        roles, bindings = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
        assert sorted(r["metadata"]["namespace"] for r in roles) == namespaces
        assert sorted(b["metadata"]["namespace"] for b in bindings) == namespaces
        for b in bindings:
            assert b["subjects"] == [{"kind": "ServiceAccount", "name": "rg-rankguard", "namespace": "ops"}]
            assert b["roleRef"]["kind"] == "Role"
        (deploy,) = by_kind(docs, "Deployment")
        env = {e["name"]: e["value"] for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["RANKGUARD_WATCH_NAMESPACES"] == ",".join(namespaces)
    # The same rules, whichever the scope; the ClusterRole adds only what a Role cannot grant.
    (cluster_role,) = by_kind(render("ops"), "ClusterRole")
    for role in by_kind(docs, "Role"):
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
def test_rendered_manifests_pass_server_side_dry_run(cluster: ControlPlane, namespace: str) -> None:
    # Every kind the chart can render except the ServiceMonitor, whose CRD belongs to the
    # prometheus-operator and is not on this cluster (its fields are checked above).
    for values in (
        ["--set", f"networkPolicy.enabled=true,networkPolicy.namespaces={{{namespace}}}"],
        ["--set", "rbac.namespaced=true"],
    ):
        docs = render(namespace, *NO_NODE, *values, crds=True)
        manifest = yaml.safe_dump_all(docs)
        r = cluster.kubectl(
            "apply",
            "--server-side",
            "--dry-run=server",
            "--field-manager=rankguard-tests",
            "-f",
            "-",
            input=manifest,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        applied = [line for line in r.stdout.splitlines() if "serverside-applied (server dry run)" in line]
        assert len(applied) == len(docs), r.stdout


@pytest.fixture(scope="module")
def restricted_release(cluster: ControlPlane, api: client.ApiClient) -> Iterator[Release]:
    """The chart installed, as a platform team would, into a namespace enforcing "restricted"."""
    core = client.CoreV1Api(api)
    ns = make_namespace(
        core,
        "t-chart-restricted",
        {
            "pod-security.kubernetes.io/enforce": "restricted",
            "pod-security.kubernetes.io/enforce-version": "latest",
        },
    )
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

    def dry_run_create(spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "operator-dry-run", "namespace": rel.namespace},
            "spec": spec,
        }
        return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)

    spec = operator_pod_spec(cluster, rel)
    ok = dry_run_create(spec)
    assert ok.returncode == 0, ok.stderr
    # The same pod with privilege escalation allowed and no seccomp profile: must be refused,
    # or the check above proves nothing.
    weaker = json.loads(json.dumps(spec))
    weaker["securityContext"].pop("seccompProfile")
    for c in weaker["containers"]:
        c["securityContext"]["allowPrivilegeEscalation"] = True
        c["securityContext"].pop("seccompProfile")
    refused = dry_run_create(weaker)
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
    for ns in (rel.namespace, "default"):  # cluster-wide: the same grants in any namespace
        baseline = can_i_list(cluster, ns, f"{rel.namespace}:no-bindings")
        granted = can_i_list(cluster, ns, f"{rel.namespace}:{rel.fullname}")
        assert baseline <= granted
        assert granted - baseline == CLUSTER_WIDE, (
            f"in {ns}: more than documented: {sorted(granted - baseline - CLUSTER_WIDE)}; "
            f"missing: {sorted(CLUSTER_WIDE - (granted - baseline))}"
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
        # Not even in its own namespace, which it does not watch, nor anywhere else.
        for elsewhere in (namespace, "default"):
            assert can_i_list(cluster, elsewhere, f"{namespace}:{rel.fullname}") == can_i_list(
                cluster, elsewhere, f"{namespace}:no-bindings"
            )
        rbac = client.RbacAuthorizationV1Api(api)
        selector = f"app.kubernetes.io/instance={rel.name}"
        assert rbac.list_cluster_role(label_selector=selector).items == []
        assert rbac.list_cluster_role_binding(label_selector=selector).items == []
    finally:
        helm_uninstall(cluster, rel)
        delete_namespace(core, watched)


def test_helm_uninstall_removes_the_operator_and_keeps_the_crd(
    cluster: ControlPlane, api: client.ApiClient, namespace: str
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
    assert installed["networkpolicies"] == [f"{rel.fullname}-agent"]
    assert ext.read_custom_resource_definition(CRD_NAME).metadata.name == CRD_NAME

    helm_uninstall(cluster, rel)
    assert operator_objects() == {kind: [] for kind in installed}
    # Helm never deletes what it installed from crds/: LLMServices (and their serving pods) survive.
    assert ext.read_custom_resource_definition(CRD_NAME).metadata.deletion_timestamp is None
