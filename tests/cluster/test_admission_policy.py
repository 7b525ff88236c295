"""The chart's pod-provenance admission policy against the real API server and controllers.

The red team's forgeries were a pod created with rankguard's labels and an ownerReference to
the service's real ReplicaSet (the ReplicaSet controller then deleted a real serving pod for
it), and an orphan pod that wrote the agent's CUDA-OOM record and was patched, once Failed, to
carry the labels and that ownerReference. The chart's ValidatingAdmissionPolicy
(templates/admission-policy.yaml), rendered by Helm and applied as a release would, must:

- refuse both (create; the late patch, as labels, as a controller ownerReference, or both),
  with a message that names the user and says what to do;
- let the real ReplicaSet and StatefulSet controllers (kube-controller-manager runs with
  --use-service-account-credentials, as kubeadm does) create pods carrying the labels;
- leave alone pods without the labels, edits that add nothing, and the garbage collector's
  orphaning (the controller ownerReference removed).

The binding is rendered for the test's namespace only (watchNamespaces), so the other tests
on the session's control plane never meet it. Helpers are test_chart.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from test_chart import CHART, by_kind, render, run_helm, template

from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.waiting import wait_for
from tests.builders import owner_ref

pytestmark = pytest.mark.cluster

LABELS = {"app.kubernetes.io/managed-by": "rankguard", "rankguard.io/llmservice": "victim"}
# No node carries this label: the controllers' pods are created (that is what is judged) and
# stay Pending, so no kubelet another test registers ever runs them.
NO_NODE = {"rankguard.io/test-no-such-node": "true"}
CONTAINER = {"name": "vllm", "image": "python:3.12", "command": ["python3", "-c", "pass"]}


def policy_docs(namespace: str) -> list[dict[str, Any]]:
    docs = render("ops", "--set", f"watchNamespaces={{{namespace}}}")
    return by_kind(docs, "ValidatingAdmissionPolicy") + by_kind(docs, "ValidatingAdmissionPolicyBinding")


def pod(
    name: str, labels: dict[str, str] | None = None, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if labels:
        meta["labels"] = dict(labels)
    if owner:
        meta["ownerReferences"] = [owner]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeSelector": NO_NODE, "containers": [CONTAINER]},
    }


def dry_run_refused(cluster: ControlPlane, namespace: str) -> bool:
    """A labelled pod, created dry run (admission judges it, nothing is stored), is refused."""
    r = cluster.kubectl(
        "create",
        "-n",
        namespace,
        "--dry-run=server",
        "-f",
        "-",
        input=json.dumps(pod("probe", LABELS)),
        check=False,
    )
    return r.returncode != 0 and "rankguard" in r.stderr


@pytest.fixture
def policy(cluster: ControlPlane, namespace: str) -> Iterator[list[dict[str, Any]]]:
    """The chart's policy and binding applied, and in force (the API server loads a new policy
    from its informer a moment after the create)."""
    docs = policy_docs(namespace)
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    cluster.kubectl("apply", "--server-side", "-f", "-", input="\n---\n".join(json.dumps(d) for d in docs))
    try:
        wait_for("the admission policy to be in force", lambda: dry_run_refused(cluster, namespace), 60)
        yield docs
    finally:
        for d in reversed(docs):
            cluster.kubectl(
                "delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found", check=False
            )


def refusal(call: Any) -> str:
    """The API server's message when `call` is refused (fails the test when it is not)."""
    try:
        call()
    except ApiException as e:
        assert e.status == 403, (e.status, e.body)
        return str(json.loads(e.body)["message"])
    raise AssertionError("the API server accepted what the admission policy must refuse")


def deployment(name: str, replicas: int) -> dict[str, Any]:
    selector = {**LABELS, "app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": selector},
                "spec": {"nodeSelector": NO_NODE, "containers": [CONTAINER]},
            },
        },
    }


def test_forged_pods_are_refused_and_the_controllers_still_create_serving_pods(
    cluster: ControlPlane, api: client.ApiClient, namespace: str, policy: list[dict[str, Any]]
) -> None:
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    me = json.loads(cluster.kubectl("auth", "whoami", "-o", "json").stdout)["status"]["userInfo"]["username"]

    # The real controllers: a Deployment's ReplicaSet and a StatefulSet make labelled pods.
    apps.create_namespaced_deployment(namespace, deployment("victim", 2))
    sts_labels = {**LABELS, "app": "group"}
    apps.create_namespaced_stateful_set(
        namespace,
        {
            "metadata": {"name": "victim-g0"},
            "spec": {
                "replicas": 1,
                "serviceName": "victim-nodes",
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": sts_labels},
                "template": {
                    "metadata": {"labels": sts_labels},
                    "spec": {"nodeSelector": NO_NODE, "containers": [CONTAINER]},
                },
            },
        },
    )

    def made() -> list[Any] | None:
        pods = core.list_namespaced_pod(namespace, label_selector="rankguard.io/llmservice=victim").items
        return pods if len(pods) == 3 else None

    pods = wait_for("the ReplicaSet's 2 pods and the StatefulSet's 1", made, 60)
    assert sorted(p.metadata.owner_references[0].kind for p in pods) == [
        "ReplicaSet",
        "ReplicaSet",
        "StatefulSet",
    ]
    (rs,) = apps.list_namespaced_replica_set(namespace, label_selector="app=victim").items
    assert not [c for c in rs.status.conditions or [] if c.type == "ReplicaFailure"]
    real = next(p for p in pods if p.metadata.owner_references[0].kind == "ReplicaSet")
    rs_owner = owner_ref("ReplicaSet", rs.metadata.uid, name=rs.metadata.name, api_version="apps/v1")
    template_labels = dict(rs.spec.template.metadata.labels)

    # (b) the race: created with the labels and the real ReplicaSet as controller
    message = refusal(
        lambda: core.create_namespaced_pod(namespace, pod("forged-race", template_labels, rs_owner))
    )
    assert "only the workload controllers" in message and me in message, message
    assert "Create or edit an LLMService" in message and "admissionPolicy.controllers" in message, message
    # the labels alone, either of them
    for labels in ({"app.kubernetes.io/managed-by": "rankguard"}, {"rankguard.io/llmservice": "victim"}):
        refusal(lambda labels=labels: core.create_namespaced_pod(namespace, pod("forged-labels", labels)))

    # (a) the late patch: an orphan without the labels is anyone's to create ...
    core.create_namespaced_pod(namespace, pod("orphan"))
    # ... but not to label, or to hand to the ReplicaSet, once it has written its record
    for patch, what in (
        ({"metadata": {"labels": template_labels, "ownerReferences": [rs_owner]}}, "labels"),
        ({"metadata": {"labels": template_labels}}, "labels"),
        ({"metadata": {"labels": {"rankguard.io/llmservice": "victim"}}}, "labels"),
    ):
        message = refusal(lambda patch=patch: core.patch_namespaced_pod("orphan", namespace, patch))
        assert f"may add rankguard's {what}" in message and me in message, message
    # a controller ownerReference on an unlabelled pod is not rankguard's business ...
    core.patch_namespaced_pod("orphan", namespace, {"metadata": {"ownerReferences": [rs_owner]}})
    # ... and the labels on it afterwards are still refused
    refusal(lambda: core.patch_namespaced_pod("orphan", namespace, {"metadata": {"labels": template_labels}}))

    # A real pod: a controller ownerReference changed to another owner is refused ...
    sts = apps.read_namespaced_stateful_set("victim-g0", namespace)
    other = owner_ref("StatefulSet", sts.metadata.uid, name="victim-g0", api_version="apps/v1")
    message = refusal(
        lambda: core.patch_namespaced_pod(
            real.metadata.name,
            namespace,
            [{"op": "replace", "path": "/metadata/ownerReferences", "value": [other]}],
        )
    )
    assert "controller ownerReference" in message, message
    # ... edits that add nothing pass, and so does orphaning it (what the garbage collector does)
    core.patch_namespaced_pod(real.metadata.name, namespace, {"metadata": {"annotations": {"note": "x"}}})
    core.patch_namespaced_pod(real.metadata.name, namespace, {"metadata": {"ownerReferences": None}})

    # the ReplicaSet controller adopts the orphan back (it matches the selector): its patch adds
    # a controller ownerReference, and passes
    def adopted() -> bool:
        refs = core.read_namespaced_pod(real.metadata.name, namespace).metadata.owner_references or []
        return any(r.controller and r.uid == rs.metadata.uid for r in refs)

    wait_for("the ReplicaSet controller to adopt the orphaned pod past the policy", adopted, 60)


def test_without_the_policy_the_same_forgery_is_accepted(
    cluster: ControlPlane, api: client.ApiClient, namespace: str
) -> None:
    """So the test above can fail: the API server itself checks neither labels nor owners."""
    assert not dry_run_refused(cluster, namespace)
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, pod("orphan"))
    core.patch_namespaced_pod("orphan", namespace, {"metadata": {"labels": LABELS}})


def test_policy_is_on_by_default_and_off_by_its_value() -> None:
    docs = render("ops")
    (vap,) = by_kind(docs, "ValidatingAdmissionPolicy")
    (binding,) = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == vap["metadata"]["name"] == "rg-rankguard-pod-provenance"
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"]  # cluster-wide install: every namespace
    controller = next(v["expression"] for v in vap["spec"]["variables"] if v["name"] == "controller")
    for user in (
        "system:serviceaccount:kube-system:replicaset-controller",
        "system:serviceaccount:kube-system:statefulset-controller",
        "system:serviceaccount:lws-system:lws-controller-manager",
    ):
        assert f'"{user}"' in controller
    off = render("ops", "--set", "admissionPolicy.enabled=false")
    assert not by_kind(off, "ValidatingAdmissionPolicy") and not by_kind(
        off, "ValidatingAdmissionPolicyBinding"
    )
    no_lws = render("ops", "--set", "admissionPolicy.leaderWorkerSetController=")
    (vap,) = by_kind(no_lws, "ValidatingAdmissionPolicy")
    assert "lws" not in next(v["expression"] for v in vap["spec"]["variables"] if v["name"] == "controller")
    (binding,) = by_kind(render("ops", "--set", "rbac.namespaced=true"), "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"] == ["ops"]


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        (["--set", "admissionPolicy.enabled=maybe"], "/admissionPolicy/enabled"),
        (["--set", "admissionPolicy.controllers[0]=has space"], "/admissionPolicy/controllers/0"),
        (["--set", "admissionPolicy.unknown=1"], "unknown"),
    ],
)
def test_schema_refuses_bad_policy_values_naming_them(values: list[str], complaint: str) -> None:
    r = template("-n", "ops", *values, check=False)
    assert r.returncode != 0 and complaint in r.stderr, r.stderr


def test_an_older_kubernetes_is_told_to_upgrade_or_turn_the_policy_off() -> None:
    r = run_helm("template", "rg", str(CHART), "--kube-version=v1.29.6", check=False)
    assert r.returncode != 0
    assert "needs Kubernetes 1.30" in r.stderr and "admissionPolicy.enabled=false" in r.stderr, r.stderr
    ok = run_helm(
        "template",
        "rg",
        str(CHART),
        "--kube-version=v1.29.6",
        "--set",
        "admissionPolicy.enabled=false",
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
