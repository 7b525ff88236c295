"""The chart's values for the operator pod, rendered by the real Helm and judged by the API server.

- leader election: the env the operator reads (RANKGUARD_LEADER_ELECTION, _LEASE_NAME,
  _LEASE_NAMESPACE, _POD_NAME), a Role for exactly one Lease, a rolling update; without it one
  Recreate'd replica and no Lease rules, and more replicas refused.
- Helm's schema validation refuses unknown and mistyped values, down into the values that take
  whole Kubernetes objects, with a message naming the value; contradictory values fail with
  a message that says what to set.
- scheduling (affinity, topology spread), the PodDisruptionBudget, the security contexts,
  extra env/volumes/mounts, the log level and commonLabels render where they belong, and the
  API server accepts the result (server-side dry run; the restricted Pod Security admission
  for the overridden pod).

Helpers (render, template, by_kind, env_of, dry_run_apply) are test_chart.py's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from test_chart import (
    NO_NODE,
    RESTRICTED,
    by_kind,
    delete_namespace,
    dry_run_apply,
    dry_run_create_pod,
    env_of,
    make_namespace,
    render,
    template,
)

from rankguard_sim.kube.cluster import ControlPlane

pytestmark = pytest.mark.cluster

SELECTOR = {
    "app.kubernetes.io/name": "rankguard",
    "app.kubernetes.io/instance": "rg",
    "app.kubernetes.io/component": "operator",
}


def operator_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deploy,) = by_kind(docs, "Deployment")
    pod: dict[str, Any] = deploy["spec"]["template"]["spec"]
    return pod


# --------------------------------------------------------------------------- leader election
def test_leader_election_gives_the_operator_its_lease_and_a_rolling_update() -> None:
    docs = render("ops", "--set", "replicaCount=2,leaderElection.leaseName=rankguard-leader")
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    env = env_of(operator_pod(docs)["containers"][0])
    assert env["RANKGUARD_LEADER_ELECTION"] == "true"
    assert env["RANKGUARD_LEASE_NAME"] == "rankguard-leader"
    assert env["RANKGUARD_LEASE_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["RANKGUARD_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # A Role for that Lease in the release namespace, bound to the operator's account.
    (role,) = [r for r in by_kind(docs, "Role") if r["metadata"]["name"].endswith("-leader-election")]
    assert role["metadata"]["namespace"] == "ops"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["rankguard-leader"],
            "verbs": ["get", "update"],
        },
    ]
    (binding,) = [b for b in by_kind(docs, "RoleBinding") if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rg-rankguard", "namespace": "ops"}]
    # The default Lease is named after the release.
    (default,) = by_kind(render("ops"), "Deployment")
    assert (
        env_of(default["spec"]["template"]["spec"]["containers"][0])["RANKGUARD_LEASE_NAME"] == "rg-rankguard"
    )


def test_without_leader_election_one_recreated_replica_and_no_lease() -> None:
    docs = render("ops", "--set", "leaderElection.enabled=false")
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    env = env_of(operator_pod(docs)["containers"][0])
    assert env["RANKGUARD_LEADER_ELECTION"] == "false"
    assert not {"RANKGUARD_LEASE_NAME", "RANKGUARD_LEASE_NAMESPACE", "RANKGUARD_POD_NAME"} & set(env)
    assert not [r for r in by_kind(docs, "Role") if "leases" in str(r["rules"])]


# --------------------------------------------------------------------------- the schema
@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (["--set", "image.tga=1.0"], "tga"),  # a misspelt key is refused, not ignored
        (["--set", "networkPolicy.agentPortNmae=agent"], "agentPortNmae"),
        (["--set-string", "operator.metricsPort=9090"], "metricsPort"),  # a string, not an integer
        (["--set", "rbac.namespaced=yes-please"], "namespaced"),
        (["--set", "operator.logFormat=xml"], "logFormat"),
        (["--set", "watchNamespaces={Team_A}"], "watchNamespaces"),
        (["--set", "replicaCount=-1"], "/replicaCount"),
        (["--set", "leaderElection.enabled=maybe"], "/leaderElection/enabled"),
        (["--set", "leaderElection.leaseName=Not_A_Name"], "/leaderElection/leaseName"),
        (["--set", "crds.install=yes-please"], "/crds/install"),
        (["--set", "operator.logLevel=verbose"], "/operator/logLevel"),
        (["--set", "affinity.nodeAfinity.x=1"], "nodeAfinity"),  # a typo deep in a Kubernetes object
        (["--set-json", 'topologySpreadConstraints=[{"maxSkew": 1}]'], "topologyKey"),  # required
        (["--set-json", 'extraEnv=[{"value": "1"}]'], "name"),
        (["--set-json", 'extraEnv=[{"name": "X", "value": 1}]'], "/extraEnv/0/value"),
        (["--set-json", 'extraVolumes=[{"name": "h", "hostPath": {"path": "/"}}]'], "hostPath"),
        (["--set-json", 'extraVolumeMounts=[{"name": "h"}]'], "mountPath"),
        (["--set", "podSecurityContext.runAsUser=0"], "/podSecurityContext/runAsUser"),  # never root
        (["--set", "securityContext.capabilities.drop=ALL"], "/securityContext/capabilities/drop"),
        (["--set", "podDisruptionBudget.minAvailable=150%"], "/podDisruptionBudget/minAvailable"),
        (["--set-string", "commonLabels.team=not a label value"], "/commonLabels/team"),
        (["--set", "networkPolicy.allowMonitoring.namespace=Monitoring"], "/networkPolicy/allowMonitoring"),
        (["--set", "agentPodMonitor.interval=30"], "/agentPodMonitor/interval"),
        (["--set", "metrics.dashboard.labels.grafana_dashboard=1"], "/metrics/dashboard/labels"),
    ],
)
def test_schema_refuses_bad_values_naming_them(values: list[str], complaint: str) -> None:
    r = template(*values, check=False)
    assert r.returncode != 0, f"helm accepted {values}"
    assert "values don't meet the specifications of the schema" in r.stderr, r.stderr
    assert complaint in r.stderr, r.stderr


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (["--set", "networkPolicy.enabled=true"], "needs networkPolicy.namespaces"),
        (["--set", "serviceAccount.create=false"], "needs serviceAccount.name"),
        (["--set", "metrics.serviceMonitor.enabled=true,metrics.service.enabled=false"], "needs metrics"),
        # Two operators without a leader would both act.
        (
            ["--set", "replicaCount=2,leaderElection.enabled=false"],
            "replicaCount=2 needs leaderElection.enabled=true",
        ),
        (
            ["--set", "podDisruptionBudget.enabled=true,podDisruptionBudget.maxUnavailable=1"],
            "needs exactly one of podDisruptionBudget.minAvailable and podDisruptionBudget.maxUnavailable",
        ),
        (
            ["--set-json", 'extraEnv=[{"name": "RANKGUARD_LOG_LEVEL", "value": "debug"}]'],
            "extraEnv sets RANKGUARD_LOG_LEVEL, which the chart sets from its values",
        ),
    ],
)
def test_contradictory_values_fail_with_a_message_that_says_what_to_set(
    values: list[str], complaint: str
) -> None:
    r = template(*values, check=False)
    assert r.returncode != 0
    assert complaint in r.stderr, r.stderr


# --------------------------------------------------------------------------- the operator pod
SPREAD = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
AFFINITY = {
    "podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 100,
                "podAffinityTerm": {
                    "topologyKey": "kubernetes.io/hostname",
                    "labelSelector": {"matchLabels": SELECTOR},
                },
            }
        ]
    }
}


def test_scheduling_values_reach_the_pod_and_a_spread_selects_the_operators_own_pods() -> None:
    spread = [
        SPREAD,
        {
            "maxSkew": 2,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": "x"}},
        },
    ]
    pod = operator_pod(
        render(
            "ops",
            "--set-json",
            f"affinity={json.dumps(AFFINITY)}",
            "--set-json",
            f"topologySpreadConstraints={json.dumps(spread)}",
            "--set-string",
            "nodeSelector.kubernetes\\.io/os=linux",
        )
    )
    assert pod["affinity"] == AFFINITY
    assert pod["topologySpreadConstraints"] == [
        {**spread[0], "labelSelector": {"matchLabels": SELECTOR}},  # filled in: the operator's pods
        spread[1],  # given: kept
    ]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    default = operator_pod(render("ops"))
    assert not {"affinity", "topologySpreadConstraints", "nodeSelector", "tolerations"} & set(default)


def test_pod_disruption_budget_only_when_enabled_with_the_budget_given() -> None:
    assert by_kind(render("ops"), "PodDisruptionBudget") == []
    for values, budget in (
        (["--set", "podDisruptionBudget.enabled=true"], {"minAvailable": 1}),
        (
            [
                *("--set", "podDisruptionBudget.enabled=true,podDisruptionBudget.minAvailable=null"),
                *("--set-string", "podDisruptionBudget.maxUnavailable=50%"),
            ],
            {"maxUnavailable": "50%"},
        ),
    ):
        (pdb,) = by_kind(render("ops", *values), "PodDisruptionBudget")
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"] == {**budget, "selector": {"matchLabels": SELECTOR}}


RESTRICTED_POD = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "seccompProfile": {"type": "RuntimeDefault"},
}
RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def test_security_contexts_default_to_restricted_and_are_overridable() -> None:
    pod = operator_pod(render("ops"))
    # What the chart rendered before they became values.
    assert pod["securityContext"] == RESTRICTED_POD
    assert pod["containers"][0]["securityContext"] == RESTRICTED_CONTAINER
    pod = operator_pod(
        render(
            "ops",
            "--set",
            "podSecurityContext.fsGroup=2000,podSecurityContext.runAsUser=null,podSecurityContext.runAsGroup=null",
            "--set",
            "securityContext.runAsUser=1001,securityContext.seccompProfile.type=Localhost",
            "--set",
            "securityContext.seccompProfile.localhostProfile=profiles/operator.json",
        )
    )
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "fsGroup": 2000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["containers"][0]["securityContext"] == {
        **RESTRICTED_CONTAINER,
        "runAsUser": 1001,
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/operator.json"},
    }


def test_extra_env_volumes_mounts_and_log_level_reach_the_container() -> None:
    pod = operator_pod(
        render(
            "ops",
            "--set",
            "operator.logLevel=debug",
            "--set-json",
            'extraEnv=[{"name": "RANKGUARD_SCRAPE_INTERVAL", "value": "10"}, {"name": "TOKEN",'
            ' "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]',
            "--set-json",
            'extraVolumes=[{"name": "ca", "configMap": {"name": "ca-bundle"}}]',
            "--set-json",
            'extraVolumeMounts=[{"name": "ca", "mountPath": "/etc/ca", "readOnly": true}]',
        )
    )
    (c,) = pod["containers"]
    env = env_of(c)
    assert env["RANKGUARD_LOG_LEVEL"] == "debug"
    assert env["RANKGUARD_SCRAPE_INTERVAL"] == "10"
    assert env["TOKEN"] == {"secretKeyRef": {"name": "s", "key": "k"}}
    assert [e["name"] for e in c["env"]][-2:] == ["RANKGUARD_SCRAPE_INTERVAL", "TOKEN"]  # after the chart's
    assert c["volumeMounts"] == [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "ca", "mountPath": "/etc/ca", "readOnly": True},
    ]
    assert pod["volumes"][1:] == [{"name": "ca", "configMap": {"name": "ca-bundle"}}]
    # No option reaches the entrypoint: `python -m rankguard_operator` takes none (env only).
    assert "args" not in c and "command" not in c


def test_common_labels_on_every_object_and_the_selectors_stay_fixed() -> None:
    values = [
        "--set",
        "commonLabels.team=ml,commonLabels.app\\.kubernetes\\.io/instance=hijack,podDisruptionBudget.enabled=true",
        "--set",
        "metrics.prometheusRule.enabled=true,metrics.dashboard.enabled=true,agentPodMonitor.enabled=true",
        "--set",
        "metrics.serviceMonitor.enabled=true,networkPolicy.enabled=true,networkPolicy.namespaces={team-a}",
    ]
    docs = render("ops", *values)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "PodDisruptionBudget", "PodMonitor", "PrometheusRule", "Pod"} <= kinds
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["team"] == "ml", d["kind"]
        assert labels["app.kubernetes.io/instance"] == "rg", d["kind"]  # the chart's label wins
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["selector"]["matchLabels"] == SELECTOR
    assert deploy["spec"]["template"]["metadata"]["labels"]["team"] == "ml"
    (svc,) = by_kind(docs, "Service")
    assert svc["spec"]["selector"] == SELECTOR


# --------------------------------------------------------------------------- the API server
def test_the_api_server_accepts_every_operator_pod_value(
    cluster: ControlPlane, api: client.ApiClient, crd: str
) -> None:
    core = client.CoreV1Api(api)
    ns = make_namespace(core, "t-chart-values", RESTRICTED)
    try:
        docs = render(
            ns,
            *NO_NODE,
            "--set",
            "replicaCount=2,podDisruptionBudget.enabled=true,commonLabels.team=ml,podSecurityContext.fsGroup=2000",
            "--set-json",
            f"affinity={json.dumps(AFFINITY)}",
            "--set-json",
            "topologySpreadConstraints=" + json.dumps([SPREAD]),
            "--set-json",
            'extraEnv=[{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]',
            "--set-json",
            'extraVolumes=[{"name": "token", "projected": {"sources": [{"serviceAccountToken":'
            ' {"path": "t", "audience": "vault", "expirationSeconds": 3600}}]}}]',
            "--set-json",
            'extraVolumeMounts=[{"name": "token", "mountPath": "/var/run/vault", "readOnly": true}]',
        )
        dry_run_apply(cluster, [d for d in docs if d["kind"] != "Pod"])  # the helm test pod: a hook
        # The pod, as the ReplicaSet would create it, passes the restricted Pod Security admission
        # (its ServiceAccount must exist for that: created for real).
        core.create_namespaced_service_account(ns, by_kind(docs, "ServiceAccount")[0])
        r = dry_run_create_pod(cluster, ns, operator_pod(docs))
        assert r.returncode == 0, r.stderr
    finally:
        delete_namespace(core, ns)
