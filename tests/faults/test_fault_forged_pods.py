"""Drill 3: pods that only look like the service's must not move its KV budget.

(Over 450 lines because the drill is one story: every forgery is made beside the same Ready
service and judged over the same operator passes, with the admission policy and without.)

Labels are not a trust boundary: anyone allowed to create pods in the namespace can give a
pod rankguard's labels. Next to a Ready service the drill creates, as such a person would,
pods with the labels and annotations of the service's pod template (so they look like pods of
the template in effect), none made by the service's ReplicaSet:

- `forged-oom`: no owner; its termination message claims rank 0 ran out of GPU memory,
  in the agent's own format (what the operator reads from a real pod's status).
- `forged-owner`: the same claim, with an ownerReference that names the LLMService itself
  as its controller (the chain must go ReplicaSet -> Deployment -> LLMService).
- `forged-report`: no owner; Ready, it serves the agent's `/report` on the agent port with
  the real agent's figures, except that every rank has no free memory left.

Owner references prove nothing either (issue 30): the red team moved the budget to the floor
with pods naming the service's real ReplicaSet. So, named as that ReplicaSet names its pods
(`<rs-name>-<5 characters>`) unless said otherwise, and with its pod-template-hash label:

- (a) `late`: an orphan without labels writes the same claim, goes Failed, and only then is
  patched to carry the labels and the real ReplicaSet as controller (which never counts or
  deletes a Failed pod). Ignored: not-from-template.
- (b) `race`: created with the labels and the real ReplicaSet as controller (the ReplicaSet
  controller may delete it, or a real pod, as one replica too many). Ignored: not-from-template.
- (c) `forged-copy`: the ReplicaSet's pod template copied exactly, under a name of its own, on
  a node that does not exist (it never runs), held by a finalizer. Ignored: wrong-name.
- (d) `fin`: (b) held by a finalizer, so it lingers whatever the controller does.
- (e) `init` (issue 50): the ReplicaSet's pod template copied (the vllm container, restartPolicy
  and name as the real pod's) but the agent-install init container swapped for one that writes
  a fake agent, which writes the claim and exits; created as an orphan without labels, held by
  a finalizer, deleted once the claim is in its status (the ReplicaSet controller never counts
  a pod being deleted), then patched to carry the labels and the real ReplicaSet as controller.
  Ignored: not-from-template (the init container is compared); and its claim, written before
  the pod was anyone's, would not count even if it were not (core/step/trust).

Once they have reached the state that used to trigger action (terminated with the claim;
Ready and answering; patched), the drill lets the operator make several passes and asserts
that the budget, the Deployment and the status' per-rank figures are unchanged, and that the
operator counted each pod as ignored with its reason (`rankguard_operator_pods_ignored_total`).

It runs twice: as above, and with the chart's admission policy (templates/admission-policy.yaml,
rendered by Helm and applied, since the drill runs the operator without the chart), under
which every labelled forgery and the late patch are refused by the API server, and the real
ReplicaSet controller still creates the serving pod.
"""

from __future__ import annotations

import copy
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes.client.rest import ApiException

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.names import (
    AGENT_ENTRY,
    AGENT_INIT_CONTAINER,
    TERMINATION_LOG,
    VLLM_CONTAINER,
    owner_reference,
)
from rankguard_operator.core.units import GiB, MiB
from rankguard_sim.kube import testbin
from rankguard_sim.kube.cluster import K8S_VERSION
from tests.builders import owner_ref

from .conftest import REPO, Drill, is_ready, remediation_id, revision, service_doc, wait_for, wait_observed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

SERVICE = "victim"
PASSES_OBSERVED = 5
HOLD = "rankguard.io/test-hold"  # the finalizer that keeps (c) and (d) around
# What the operator must count per reason (rankguard_operator_pods_ignored_total), by pod.
REASONS = {
    "forged-oom": "no-owner",
    "forged-owner": "no-owner",
    "forged-report": "no-owner",
    "late": "not-from-template",
    "race": "not-from-template",
    "forged-copy": "wrong-name",
    "fin": "not-from-template",
    "init": "not-from-template",
}
TOTAL = round(79.14 * GiB)  # the scenario's A100 80 GB, as PyTorch reports it
# Runs with the image's python (standard library only), as anything in a pod could.
WRITE_TERMINATION = "import os, sys; open(sys.argv[1], 'w').write(os.environ['MESSAGE']); sys.exit(1)"
# (e)'s init container: writes the fake agent where the agent-install one puts the real one.
WRITE_AGENT = "import os, sys; open(sys.argv[1], 'w').write(os.environ['AGENT'])"
# The fake agent, run by the vllm container's own command line (`python3 <agent entry> launch
# ... --termination-log <path> ...`): the claim where the real agent writes its record.
FAKE_AGENT = """
import sys
argv = sys.argv
open(argv[argv.index('--termination-log') + 1], 'w').write({claim!r})
sys.exit(1)
"""
SERVE_REPORT = """
import http.server, json, os, time
doc = json.loads(os.environ['REPORT'])
class Lie(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        doc['timestamp'] = time.time()
        body = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(('0.0.0.0', int(os.environ['PORT'])), Lie).serve_forever()
"""


def oom_claim() -> str:
    return tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=0,
        gpu_index=0,
        requested_bytes=8 * GiB,
        free_bytes=100 * MiB,
        total_bytes=TOTAL,
        detail=(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a "
            "total capacity of 79.14 GiB of which 100.00 MiB is free."
        ),
    ).to_json()


def forged_pod(
    name: str, template: dict[str, Any], node: str, container: dict[str, Any], **spec: Any
) -> dict[str, Any]:
    meta = template["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
        },
        "spec": {"nodeName": node, "containers": [{"name": VLLM_CONTAINER, **container}], **spec},
    }


def agent_port(deployment: dict[str, Any]) -> int:
    for c in deployment["spec"]["template"]["spec"]["containers"]:
        for p in c.get("ports") or []:
            if p.get("name") == "agent":
                return int(p["containerPort"])
    raise AssertionError("the Deployment's pod template has no port named agent")


def fetch_report(ip: str, port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://{ip}:{port}/report", timeout=2) as r:
            return dict(json.loads(r.read()))
    except (OSError, ValueError):
        return None


def terminated_with_claim(pod: dict[str, Any] | None) -> bool:
    """A container's run ended with the claim (the run just ended, or the one before a restart)."""
    for cs in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        for view in ("state", "lastState"):
            message = ((cs.get(view) or {}).get("terminated") or {}).get("message") or ""
            if tm.CUDA_OOM in message:
                return True
    return False


def fake_agent_installer(rs_template: dict[str, Any], name: str, node: str) -> dict[str, Any]:
    """(e): the ReplicaSet's pod template, but its agent-install init container writes a fake
    agent; an orphan without labels (anyone's to create), held by the drill's finalizer."""
    spec = copy.deepcopy(rs_template["spec"])
    spec["nodeName"] = node
    for init in spec["initContainers"]:
        if init["name"] == AGENT_INIT_CONTAINER:
            # the agent entry as an argument: the process kubelet rewrites it to the volume's folder
            init.update(
                image="python:3.12",
                command=["python3", "-c", WRITE_AGENT, AGENT_ENTRY],
                env=[{"name": "AGENT", "value": FAKE_AGENT.format(claim=oom_claim())}],
            )
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "annotations": dict(rs_template["metadata"].get("annotations") or {}),
            "finalizers": [HOLD],
        },
        "spec": spec,
    }


def stopped_by_kubelet(pod: dict[str, Any] | None) -> bool:
    """A deleted pod whose kubelet has stopped it and confirmed (a finalizer holds the object)."""
    meta = (pod or {}).get("metadata") or {}
    return bool(meta.get("deletionTimestamp")) and meta.get("deletionGracePeriodSeconds") == 0


def pod_ready(pod: dict[str, Any] | None) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in ((pod or {}).get("status") or {}).get("conditions") or []
    )


def admission_policy(d: Drill) -> list[dict[str, Any]]:
    """The chart's policy and binding (the binding for the drill's namespace only), rendered
    by Helm as a release renders them."""
    r = subprocess.run(
        [
            str(testbin.testbin_dir() / "helm"),
            "template",
            "rg",
            str(REPO / "charts" / "rankguard"),
            f"--kube-version={K8S_VERSION}",
            "--set",
            f"watchNamespaces={{{d.namespace}}}",
            "--show-only",
            "templates/admission-policy.yaml",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [doc for doc in yaml.safe_load_all(r.stdout) if doc]


def labelled_create_refused(d: Drill) -> bool:
    probe: dict[str, Any] = {
        "metadata": {"name": "probe", "labels": {"rankguard.io/llmservice": SERVICE}},
        "spec": {"containers": [{"name": VLLM_CONTAINER, "image": "python:3.12"}]},
    }
    try:
        d.core.create_namespaced_pod(d.namespace, probe, dry_run="All")
    except ApiException as e:
        return bool(e.status == 403)
    return False


@pytest.fixture(params=["without-policy", "with-policy"])
def policy(request: pytest.FixtureRequest, drill: Drill) -> Iterator[bool]:
    """With the policy: applied (and in force) before the service, so the drill also shows the
    ReplicaSet controller creating the serving pod past it; removed afterwards."""
    on = request.param == "with-policy"
    docs = admission_policy(drill) if on else []
    if on:
        drill.cp.kubectl(
            "apply", "--server-side", "-f", "-", input="\n---\n".join(json.dumps(x) for x in docs)
        )
        wait_for("the admission policy in force", lambda: labelled_create_refused(drill), 60)
    try:
        yield on
    finally:
        for doc in reversed(docs):
            drill.cp.kubectl(
                "delete", doc["kind"].lower(), doc["metadata"]["name"], "--ignore-not-found", check=False
            )


def create_or_refusal(d: Drill, pod: dict[str, Any]) -> str | None:
    """Create `pod`; None when created, else the API server's message."""
    try:
        d.core.create_namespaced_pod(d.namespace, pod)
    except ApiException as e:
        assert e.status == 403, (e.status, e.body)
        return str(json.loads(e.body)["message"])
    return None


def release_held(d: Drill) -> None:
    """Drop the drill's finalizer, or the namespace would never go away."""
    for p in d.pods():
        if HOLD in (p["metadata"].get("finalizers") or []):
            try:
                d.core.patch_namespaced_pod(
                    p["metadata"]["name"], d.namespace, [{"op": "remove", "path": "/metadata/finalizers"}]
                )
            except ApiException as e:
                if e.status != 404:
                    raise


def test_forged_pods_and_lying_reports_change_no_budget(drill: Drill, policy: bool) -> None:
    d = drill
    try:
        run_drill(d, policy)
    finally:
        release_held(d)


def run_drill(d: Drill, policy: bool) -> None:
    node = d.start_node(services=1)
    d.start_operator(metrics=True)
    d.create_service(service_doc(SERVICE, start_at_default=False))

    def ready_with_ranks() -> dict[str, Any] | None:
        svc = d.service(SERVICE)
        st = svc.get("status") or {}
        fresh = [r for r in st.get("ranks") or [] if not r.get("stale")]
        return svc if is_ready(svc) and len(fresh) == 4 and (st.get("budget") or {}) else None

    svc = wait_for("the service Ready with every rank reported", ready_with_ranks, 240, dump=d.dump)
    dep = wait_observed(d, SERVICE)
    template = dep["spec"]["template"]
    port = agent_port(dep)
    real = [p for p in d.pods() if pod_ready(p) and p["metadata"].get("ownerReferences")]
    assert len(real) == 1, [p["metadata"]["name"] for p in real]
    report = wait_for("the real agent's report", lambda: fetch_report(real[0]["status"]["podIP"], port), 30)
    for rank in report["ranks"]:
        rank.update(free_bytes=0, min_free_bytes=0, used_bytes=rank["total_bytes"])
    (rs,) = [r for r in d.replicasets_of(dep) if r["spec"].get("replicas")]
    rs_name, rs_template = rs["metadata"]["name"], rs["spec"]["template"]
    rs_owner = owner_ref(
        "ReplicaSet", rs["metadata"]["uid"], name=rs_name, api_version="apps/v1", block_owner_deletion=True
    )

    # the terminationMessagePath as an argument: the process kubelet rewrites it to the file
    claim = {
        "image": "python:3.12",
        "command": ["python3", "-c", WRITE_TERMINATION, TERMINATION_LOG],
        "env": [{"name": "MESSAGE", "value": oom_claim()}],
    }
    forged_owner = forged_pod("forged-owner", template, node.node_name, claim, restartPolicy="Never")
    # the LLMService as the pod's controller, as rankguard makes it the Deployment's
    forged_owner["metadata"]["ownerReferences"] = [owner_reference(SERVICE, svc["metadata"]["uid"])]
    server = {
        "image": "python:3.12",
        "command": ["python3", "-c", SERVE_REPORT],
        "env": [{"name": "REPORT", "value": json.dumps(report)}, {"name": "PORT", "value": str(port)}],
        "ports": [{"name": "agent", "containerPort": port}],
    }

    def of_the_replicaset(name: str, pod: dict[str, Any], *, hold: bool = False) -> dict[str, Any]:
        """`pod` with the ReplicaSet's own labels (pod-template-hash too) and it as controller."""
        pod["metadata"].update(
            name=name,
            labels=dict(rs_template["metadata"]["labels"]),
            ownerReferences=[rs_owner],
        )
        if hold:
            pod["metadata"]["finalizers"] = [HOLD]
        return pod

    def named(key: str) -> str:
        # (a), (b), (d) are named as the ReplicaSet names its pods: only their spec gives them away
        return {
            "late": f"{rs_name}-late2",
            "race": f"{rs_name}-race2",
            "fin": f"{rs_name}-fin22",
            "init": f"{rs_name}-init2",
        }.get(key, key)

    copied = {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": copy.deepcopy(rs_template["spec"])}
    copied["metadata"]["annotations"] = dict(rs_template["metadata"].get("annotations") or {})
    copied["spec"]["nodeName"] = f"{d.namespace}-nowhere"  # the real template, never run
    labelled = [
        forged_pod("forged-oom", template, node.node_name, claim, restartPolicy="Never"),
        forged_owner,
        forged_pod("forged-report", template, node.node_name, server),
        of_the_replicaset(
            named("race"), forged_pod("x", template, node.node_name, claim, restartPolicy="Never")
        ),
        of_the_replicaset("forged-copy", copied, hold=True),
        of_the_replicaset(
            named("fin"), forged_pod("x", template, node.node_name, claim, restartPolicy="Never"), hold=True
        ),
    ]
    refusals = {p["metadata"]["name"]: create_or_refusal(d, p) for p in labelled}
    # (a): an orphan without labels is anyone's to create
    late = forged_pod(named("late"), template, node.node_name, claim, restartPolicy="Never")
    late["metadata"]["labels"] = {}
    d.core.create_namespaced_pod(d.namespace, late)
    # (e): an orphan too, until its claim is written
    d.core.create_namespaced_pod(
        d.namespace, fake_agent_installer(rs_template, named("init"), node.node_name)
    )

    def pod_named(name: str) -> dict[str, Any] | None:
        return next((p for p in d.pods() if p["metadata"]["name"] == name), None)

    def forged_in_place() -> bool:
        late_done = terminated_with_claim(pod_named(named("late"))) and terminated_with_claim(
            pod_named(named("init"))
        )
        if policy:
            return late_done
        lying = pod_named("forged-report")
        lie = fetch_report(lying["status"]["podIP"], port) if lying and pod_ready(lying) else None
        return (
            late_done
            and terminated_with_claim(pod_named("forged-oom"))
            and terminated_with_claim(pod_named("forged-owner"))
            and lie is not None
            and all(r["min_free_bytes"] == 0 for r in lie["ranks"])
        )

    wait_for("the forged pods to claim an OOM and serve the lie", forged_in_place, 120, dump=d.dump)
    assert (pod_named(named("late")) or {}).get("status", {}).get("phase") == "Failed"
    # (e) deleted with its claim in its status: the finalizer keeps it, stopped, and the
    # ReplicaSet controller counts no pod being deleted, so nothing removes it
    d.core.delete_namespaced_pod(named("init"), d.namespace)
    wait_for(
        "the kubelet to stop the deleted fake-agent pod",
        lambda: stopped_by_kubelet(pod_named(named("init"))),
        60,
        dump=d.dump,
    )
    assert terminated_with_claim(pod_named(named("init")))
    # (a), (e) the late patch: the labels and the real ReplicaSet as controller, once ended
    patch = {"metadata": {"labels": dict(rs_template["metadata"]["labels"]), "ownerReferences": [rs_owner]}}
    for late_one in ("late", "init"):
        try:
            d.core.patch_namespaced_pod(named(late_one), d.namespace, patch)
            refusals[late_one] = None
        except ApiException as e:
            assert e.status == 403, (e.status, e.body)
            refusals[late_one] = str(json.loads(e.body)["message"])

    if policy:
        # every forgery refused by the API server, each saying what to do
        for name, message in refusals.items():
            assert message is not None, f"{name}: the admission policy let the forgery through"
            assert "only the workload controllers" in message and "LLMService" in message, message
    else:
        assert refusals == dict.fromkeys(refusals), refusals
    passes = d.passes(SERVICE)
    wait_for(
        f"{PASSES_OBSERVED} operator passes over the forged pods",
        lambda: d.passes(SERVICE) >= passes + PASSES_OBSERVED,
        120,
        dump=d.dump,
    )

    after = d.service(SERVICE)
    st, old = after.get("status") or {}, svc["status"]
    dep_after = d.deployment(SERVICE)

    def ignored(reason: str | None = None) -> float:
        labels = {"namespace": d.namespace, "llmservice": SERVICE}
        return d.metric(
            "rankguard_operator_pods_ignored_total", **labels, **({"reason": reason} if reason else {})
        )

    left = {p["metadata"]["name"] for p in d.pods()}
    budget_after = (st.get("budget") or {}).get("kvCacheMemoryBytes")
    race = "still there" if named("race") in left else "gone"
    print(
        f"\nforged pods ({'with' if policy else 'without'} the admission policy): budget "
        f"{old['budget'].get('kvCacheMemoryBytes')} -> {budget_after}, "
        f"revision {revision(dep)} -> {revision(dep_after)}, "
        f"remediations {len(st.get('remediations') or [])}, "
        f"pods_ignored_total {ignored():g} "
        f"({', '.join(f'{r} {ignored(r):g}' for r in sorted(set(REASONS.values())))}), "
        f"refused {sorted(n for n, m in refusals.items() if m)}, race pod "
        f"{race}, passes observed {d.passes(SERVICE) - passes:g}"
    )
    # Each forgery, acted upon, fails one of these; the messages say which.
    assert not st.get("remediations") and not st.get("pendingRemediation"), (
        f"a forged pod's claim was acted upon: {st.get('remediations') or st.get('pendingRemediation')}"
    )
    assert st.get("servingFlags") == old["servingFlags"], "the forged pods changed the serving flags"
    assert (st.get("budget") or {}).get("kvCacheMemoryBytes") == old["budget"].get("kvCacheMemoryBytes")
    assert revision(dep_after) == revision(dep) and remediation_id(dep_after) == remediation_id(dep), (
        "the Deployment was rolled"
    )
    assert (dep_after or {})["metadata"]["generation"] == dep["metadata"]["generation"]
    lied = [r for r in st.get("ranks") or [] if r.get("minFreeBytes") == 0]
    assert not lied, f"the lying report reached status.ranks: {lied}"
    if policy:
        assert ignored() == 0, "a forged pod got past the admission policy and was seen by the operator"
        return
    # each forged pod counted once, with its reason; the race pod only if it lived to be seen
    # (the ReplicaSet controller may delete it at once, as one replica too many)
    others = sum(1 for p, why in REASONS.items() if why == "not-from-template" and p != "race")
    race_seen = 1 if named("race") in left else int(ignored("not-from-template")) - others
    assert race_seen in (0, 1), (
        f"not-from-template counted {race_seen + others} times for {others}-{others + 1} pods"
    )
    expected = {
        r: sum(1 for p, why in REASONS.items() if why == r and p != "race") for r in set(REASONS.values())
    }
    expected["not-from-template"] += race_seen
    assert {r: ignored(r) for r in expected} == expected, (
        "rankguard_operator_pods_ignored_total by reason "
        f"(namespace {d.namespace}, llmservice {SERVICE}); pods left: {sorted(left)}"
    )
