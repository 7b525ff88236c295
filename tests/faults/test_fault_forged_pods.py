"""Drill 3: pods that only look like the service's must not move its KV budget.

Labels are not a trust boundary: anyone allowed to create pods in the namespace can give a
pod rankguard's labels. Next to a Ready service the drill creates, as such a person would,
three pods with the labels and annotations of the service's pod template (so they look like
pods of the template in effect), none made by the service's ReplicaSet:

- `forged-oom`: no owner; its termination message claims rank 0 ran out of GPU memory,
  in the agent's own format (what the operator reads from a real pod's status).
- `forged-owner`: the same claim, with an ownerReference that names the LLMService itself
  as its controller (the chain must go ReplicaSet -> Deployment -> LLMService).
- `forged-report`: no owner; Ready, it serves the agent's `/report` on the agent port with
  the real agent's figures, except that every rank has no free memory left.

Once they have reached the state that used to trigger action (terminated with the claim;
Ready and answering), the drill lets the operator make several passes and asserts that the
budget, the Deployment and the status' per-rank figures are unchanged, and that the operator
counted the pods as ignored (`rankguard_operator_pods_ignored_total`).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.names import TERMINATION_LOG, VLLM_CONTAINER, owner_reference
from rankguard_operator.core.units import GiB, MiB

from .conftest import Drill, is_ready, remediation_id, revision, service_doc, wait_for, wait_observed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

SERVICE = "victim"
PASSES_OBSERVED = 5
TOTAL = round(79.14 * GiB)  # the scenario's A100 80 GB, as PyTorch reports it
# Runs with the image's python (standard library only), as anything in a pod could.
WRITE_TERMINATION = "import os, sys; open(sys.argv[1], 'w').write(os.environ['MESSAGE']); sys.exit(1)"
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
    for cs in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        message = ((cs.get("state") or {}).get("terminated") or {}).get("message") or ""
        if tm.CUDA_OOM in message:
            return True
    return False


def pod_ready(pod: dict[str, Any] | None) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in ((pod or {}).get("status") or {}).get("conditions") or []
    )


def test_forged_pods_and_lying_reports_change_no_budget(drill: Drill) -> None:
    d = drill
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
    pods = [
        forged_pod("forged-oom", template, node.node_name, claim, restartPolicy="Never"),
        forged_owner,
        forged_pod("forged-report", template, node.node_name, server),
    ]
    for pod in pods:
        d.core.create_namespaced_pod(d.namespace, pod)

    def pod_named(name: str) -> dict[str, Any] | None:
        return next((p for p in d.pods() if p["metadata"]["name"] == name), None)

    def forged_in_place() -> bool:
        lying = pod_named("forged-report")
        lie = fetch_report(lying["status"]["podIP"], port) if lying and pod_ready(lying) else None
        return (
            terminated_with_claim(pod_named("forged-oom"))
            and terminated_with_claim(pod_named("forged-owner"))
            and lie is not None
            and all(r["min_free_bytes"] == 0 for r in lie["ranks"])
        )

    wait_for("the forged pods to claim an OOM and serve the lie", forged_in_place, 120, dump=d.dump)
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
    ignored = d.metric("rankguard_operator_pods_ignored_total", namespace=d.namespace, llmservice=SERVICE)
    print(
        f"\nforged pods: budget {old['budget'].get('kvCacheMemoryBytes')} -> "
        f"{(st.get('budget') or {}).get('kvCacheMemoryBytes')}, revision {revision(dep)} -> "
        f"{revision(dep_after)}, remediations {len(st.get('remediations') or [])}, "
        f"pods_ignored_total {ignored:g}, passes observed {d.passes(SERVICE) - passes:g}"
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
    lied = [r for r in st.get("ranks") or [] if r.get("minFreeBytes") == 0]
    assert not lied, f"the lying report reached status.ranks: {lied}"
    assert ignored >= 1, (
        "rankguard_operator_pods_ignored_total has no sample for the forged pods "
        f"(namespace {d.namespace}, llmservice {SERVICE})"
    )
