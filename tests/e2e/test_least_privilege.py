"""The chart's RBAC is enough, end to end: `helm install` the chart as a platform team would,
then run the operator with nothing but its ServiceAccount's token, and watch it take the
example LLMService through a rank-0 CUDA OOM to Ready.

The chart's own operator Deployment is kept off every node (a nodeSelector nothing matches);
the operator runs here as a local process instead, exactly as in its container, but
authenticating only with a TokenRequest token for the chart's ServiceAccount. The serving
namespace is not an `e2e-*` one, so the session's admin operator never touches it: whatever
happens there was done with the chart's permissions alone. A permission the chart lacks shows
up either as a loop that never gets Ready, or as a 403 in the operator's log (kopf retries
and logs a forbidden request even when the loop survives it).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.world import OperatorProcess

from .conftest import GROUP, PLURAL, VERSION, apply_service, condition, example, get_llmservice, wait_for

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "rankguard"
# The chart's own operator pod must never run on the simulated node this test starts.
NO_NODE = ["--set-string", "nodeSelector.rankguard\\.io/test-no-such-node=true"]
# What a refused request looks like in the operator's log: kopf's retries name
# APIForbiddenError, the kubernetes client's ApiException says "(403)" / "Reason: Forbidden".
REFUSED = re.compile(r"\b403\b|forbidden", re.IGNORECASE)


@dataclass
class ChartRelease:
    name: str
    namespace: str
    account: str  # the chart's ServiceAccount (its full name with default values)


def _create_namespace(core: client.CoreV1Api, prefix: str) -> str:
    # Not `e2e-*` (the session's admin operator watches those) and not `t-*`.
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name, "labels": {"rankguard.io/test": "true"}}})
    return name


def _delete_namespace(core: client.CoreV1Api, name: str) -> None:
    try:
        core.delete_namespace(name)
    except ApiException as e:
        if e.status != 404:
            raise


@pytest.fixture
def chart_release(cluster: ControlPlane, api: client.ApiClient, crd: str) -> Iterator[ChartRelease]:
    """The chart installed cluster-wide with default RBAC, in a namespace of its own.

    The session's CRD is there first (`crd`), so this also shows that `helm install` copes
    with a CRD that already exists: the chart leaves a CRD it does not own alone.
    """
    core = client.CoreV1Api(api)
    ns = _create_namespace(core, "lp-rankguard")
    rel = ChartRelease("lp", ns, "lp-rankguard")
    try:
        r = cluster.helm("install", rel.name, str(CHART), "-n", ns, *NO_NODE, check=False)
        assert r.returncode == 0, r.stderr
        yield rel
    finally:
        # Also after a failed install, which can leave a release behind.
        u = cluster.helm("uninstall", rel.name, "-n", ns, "--wait", "--timeout=60s", check=False)
        assert u.returncode == 0 or "not found" in u.stderr, u.stderr
        _delete_namespace(core, ns)
        # The CRD is the session's and stays: Helm never deletes what it found in crds/.
        assert client.ApiextensionsV1Api(api).read_custom_resource_definition(crd).metadata.name == crd


@pytest.fixture
def serving_namespace(api: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(api)
    ns = _create_namespace(core, "lp-serving")
    try:
        yield ns
    finally:
        _delete_namespace(core, ns)


def _account_token(api: client.ApiClient, rel: ChartRelease) -> str:
    # TokenRequest: a short-lived, audience-bound token, like the one the kubelet projects into
    # the chart's operator pod. The chart's ServiceAccount does not automount a token Secret.
    tr = client.CoreV1Api(api).create_namespaced_service_account_token(
        rel.account, rel.namespace, {"spec": {"expirationSeconds": 3600}}
    )
    token = tr.status.token
    assert isinstance(token, str) and token
    return token


def _who_am_i(kubeconfig: Path) -> str:
    sa_api = config.new_client_from_config(config_file=str(kubeconfig))
    try:
        review = client.AuthenticationV1Api(sa_api).create_self_subject_review({})
        return str(review.status.user_info.username)
    finally:
        sa_api.close()


@pytest.fixture
def account_operator(
    cluster: ControlPlane,
    api: client.ApiClient,
    chart_release: ChartRelease,
    serving_namespace: str,
    tmp_path: Path,
) -> Iterator[OperatorProcess]:
    """`python -m rankguard_operator` with only the chart's ServiceAccount token, watching the
    serving namespace. On teardown the LLMServices go first, while the operator still runs to
    remove kopf's finalizer, and the serving Deployments and pods are collected before it stops."""
    kubeconfig = cluster.token_kubeconfig(
        _account_token(api, chart_release), tmp_path / "operator.kubeconfig"
    )
    assert _who_am_i(kubeconfig) == f"system:serviceaccount:{chart_release.namespace}:{chart_release.account}"
    op = OperatorProcess(
        kubeconfig,
        tmp_path / "operator.log",
        env_extra={
            "RANKGUARD_WATCH_NAMESPACES": serving_namespace,
            # as the chart's pod runs it: leading by the chart's Lease, with the chart's grant
            "RANKGUARD_LEADER_ELECTION": "true",
            "RANKGUARD_LEASE_NAME": chart_release.account,  # the chart's full name
            "RANKGUARD_LEASE_NAMESPACE": chart_release.namespace,
            "RANKGUARD_POD_NAME": "lp-operator-0",
        },
    )
    op.start()
    try:
        op.wait_ready()
        yield op
    finally:
        try:
            _delete_services_and_wait(api, serving_namespace)
        finally:
            op.stop()
        # Deleting (kopf removing its finalizer) needs permissions too.
        refused = _refused_lines(op.log)
        assert refused == [], "refused during clean-up:\n" + "\n".join(refused[:20])


def _delete_services_and_wait(api: client.ApiClient, ns: str) -> None:
    custom, apps, core = client.CustomObjectsApi(api), client.AppsV1Api(api), client.CoreV1Api(api)
    for item in custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL).get("items", []):
        try:
            custom.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, item["metadata"]["name"])
        except ApiException as e:
            if e.status != 404:
                raise
    wait_for(
        "the LLMServices (kopf's finalizer removed), their Deployments and pods to go",
        lambda: (
            not custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL).get("items")
            and not apps.list_namespaced_deployment(ns).items
            and not core.list_namespaced_pod(ns).items
        ),
        90,
    )


def _remediated_and_ready(api: client.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    svc = get_llmservice(api, ns, name)
    ready = condition(svc, "Ready")
    st = svc.get("status") or {}
    if not (ready and ready["status"] == "True" and st.get("ranks") and st.get("minHeadroom")):
        return None
    rems = st.get("remediations") or []
    return svc if any(r["trigger"] == "CUDAOutOfMemory" for r in rems) else None


def _refused_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if REFUSED.search(line)]


def test_operator_with_only_the_charts_account_remediates_to_ready(
    make_node: Callable[..., Any],
    api: client.ApiClient,
    serving_namespace: str,
    account_operator: OperatorProcess,
) -> None:
    ns = serving_namespace
    # The token really is no admin: what the chart does not grant is refused.
    token_api = config.new_client_from_config(config_file=str(account_operator.kubeconfig))
    try:
        with pytest.raises(ApiException) as denied:
            client.CoreV1Api(token_api).list_namespaced_secret(ns)
        assert denied.value.status == 403
    finally:
        token_api.close()

    make_node("llama3-70b-tp4", time_scale=4)
    doc = example()
    name = doc["metadata"]["name"]
    started = time.monotonic()
    apply_service(api, ns, doc)

    svc = wait_for(
        "a CUDA OOM remediation and a Ready service, done with the chart's account alone",
        lambda: _remediated_and_ready(api, ns, name),
        240,
        dump=lambda: {
            "status": get_llmservice(api, ns, name).get("status"),
            "refused": _refused_lines(account_operator.log)[-10:],
        },
    )
    elapsed = time.monotonic() - started
    st = svc["status"]
    (oom,) = [r for r in st["remediations"] if r["trigger"] == "CUDAOutOfMemory"]
    assert oom["rank"] == 0
    assert oom["fromFlags"] == {"gpuMemoryUtilization": 0.92}
    assert st["budget"]["kvCacheMemoryBytes"] == oom["toFlags"]["kvCacheMemoryBytes"]
    assert len(st["ranks"]) == 4
    assert all(r["headroomBytes"] > 0 for r in st["ranks"])
    assert st["bottleneckRank"] == 0

    # The remediation was told as an Event, which the account posted (the session's admin
    # operator does not watch this namespace).
    events = client.CoreV1Api(api).list_namespaced_event(
        ns, field_selector=f"involvedObject.name={name},involvedObject.kind=LLMService"
    )
    assert any("ran out of GPU memory" in (e.message or "") for e in events.items), [
        (e.reason, e.message) for e in events.items
    ]

    # The serving objects were written by the operator's field manager, under the account.
    dep = client.AppsV1Api(api).read_namespaced_deployment(name, ns)
    assert "rankguard" in {m.manager for m in dep.metadata.managed_fields or []}
    assert dep.metadata.owner_references[0].kind == "LLMService"

    # It acted as the leader, holding the Lease the chart grants it (created and renewed).
    lease_ns = account_operator.env_extra["RANKGUARD_LEASE_NAMESPACE"]
    lease_name = account_operator.env_extra["RANKGUARD_LEASE_NAME"]
    lease = client.CoordinationV1Api(api).read_namespaced_lease(lease_name, lease_ns)
    assert lease.spec.holder_identity == "lp-operator-0"

    refused = _refused_lines(account_operator.log)
    assert refused == [], "the operator was refused something the chart does not grant:\n" + "\n".join(
        refused[:20]
    )
    print(f"remediated and Ready {elapsed:.0f}s after the apply, with the chart's account only")
