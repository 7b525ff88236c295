"""Sim nodes on the real control plane: GPU Feature Discovery's labels, MIG slices as extended
resources the scheduler and the process kubelet hand out, and pods that bind 0.0.0.0 on the
same port apart, each on its own pod IP (the sandbox's stand-in for network namespaces)."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from rankguard_sim.kubelet.kubelet import ProcessKubelet
from rankguard_sim.kubelet.nodegpus import MigLayout
from rankguard_sim.physics import gpus as simgpus
from rankguard_sim.waiting import wait_for
from rankguard_sim.world import running

pytestmark = pytest.mark.cluster

MIB = 1 << 20
SLICE = "nvidia.com/mig-3g.40gb"


@pytest.fixture(scope="module")
def node(api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessKubelet]:
    root = tmp_path_factory.mktemp("mig-node")
    name = f"mig-{uuid.uuid4().hex[:6]}"
    kubelet = ProcessKubelet(
        api,
        name,
        workdir=root / "kubelet",
        gpu_root=root / "gpus",
        gpus=2,
        scenario="llama3-70b-tp4",
        mig=MigLayout(gpus=1, profiles={"3g.40gb": 2}),
        delete_node_on_stop=True,
    )
    with running(api, kubelet):
        yield kubelet


def raw_pod(core: client.CoreV1Api, ns: str, name: str) -> dict[str, Any]:
    return dict(json.loads(core.read_namespaced_pod(name, ns, _preload_content=False).data))


def test_the_node_carries_gfd_labels_and_its_mig_slices_as_resources(
    api: client.ApiClient, node: ProcessKubelet
) -> None:
    n = client.CoreV1Api(api).read_node(node.node_name)
    labels = n.metadata.labels
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert labels["nvidia.com/gpu.count"] == "3"
    assert labels["nvidia.com/gpu.memory"] == str(round(79.14 * 2**30) // MIB)
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels[f"{SLICE}.count"] == "2"
    assert n.status.capacity[SLICE] == n.status.allocatable[SLICE] == "2"
    assert n.status.capacity["nvidia.com/gpu"] == "2"


def test_a_pod_asking_for_a_slice_gets_one_device_of_the_slices_memory(
    api: client.ApiClient, namespace: str, node: ProcessKubelet
) -> None:
    core = client.CoreV1Api(api)
    show = "import os, sys; open(sys.argv[1], 'w').write(os.environ['NVIDIA_VISIBLE_DEVICES'])"
    core.create_namespaced_pod(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "on-a-slice"},
            "spec": {
                "restartPolicy": "Never",
                # no nodeSelector: the scheduler finds the node that has the resource
                "containers": [
                    {
                        "name": "main",
                        "image": "python:3.11",
                        "command": ["python3", "-c", show, "/dev/termination-log"],
                        "resources": {"limits": {SLICE: "1"}},
                    }
                ],
            },
        },
    )

    def finished() -> dict[str, Any] | None:
        pod = raw_pod(core, namespace, "on-a-slice")
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        return ((statuses[0].get("state") or {}).get("terminated") if statuses else None) or None

    term = wait_for("the pod on a MIG slice to finish", finished, timeout=60)
    assert term["exitCode"] == 0
    assert raw_pod(core, namespace, "on-a-slice")["spec"]["nodeName"] == node.node_name
    device = term["message"]
    assert device.startswith("MIG-") and device.count(",") == 0
    labels = client.CoreV1Api(api).read_node(node.node_name).metadata.labels
    total = simgpus.read_device(node.gpu_root, device).total_bytes
    assert str(total // MIB) == labels[f"{SLICE}.memory"]


SERVER = """
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ["HOSTNAME"].encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def test_two_pods_listen_on_0_0_0_0_on_one_port_each_on_its_pod_ip(
    api: client.ApiClient, namespace: str, node: ProcessKubelet
) -> None:
    core = client.CoreV1Api(api)
    for name in ("web-a", "web-b"):
        core.create_namespaced_pod(
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node.node_name},
                    "containers": [
                        {
                            "name": "main",
                            "image": "python:3.11",
                            "command": ["python3", "-c", SERVER],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "readinessProbe": {"httpGet": {"port": "http", "path": "/"}, "periodSeconds": 1},
                        }
                    ],
                },
            },
        )

    def ready(name: str) -> dict[str, Any] | None:
        pod = raw_pod(core, namespace, name)
        conditions = (pod.get("status") or {}).get("conditions") or []
        return pod if any(c["type"] == "Ready" and c["status"] == "True" for c in conditions) else None

    ips = {
        name: wait_for(f"{name} to be Ready", lambda n=name: ready(n), 60)["status"]["podIP"]
        for name in ("web-a", "web-b")
    }
    assert ips["web-a"] != ips["web-b"]
    for name, ip in ips.items():
        with urllib.request.urlopen(f"http://{ip}:8080/", timeout=5) as r:
            assert r.read().decode() == name
        restarts = raw_pod(core, namespace, name)["status"]["containerStatuses"][0]["restartCount"]
        assert restarts == 0  # neither lost the port to the other
