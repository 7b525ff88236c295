"""The sandbox's cluster DNS (kube/dns.py): the EndpointSlices the controller would publish for a
headless Service's pods (the API refuses the sandbox's loopback pod IPs in real ones), the names
CoreDNS answers from an EndpointSlice document, written as a hosts file and resolved from it; and
the kubelet's reading of a pod's node rank (the GPUs' world facts are the node's global ranks')."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rankguard_sim.kube.dns import (
    HOSTS_FILE_ENV,
    endpoint_slices,
    records,
    render_hosts,
    resolve,
    write_hosts,
)
from rankguard_sim.kubelet.nodegpus import NodeGpus, node_rank
from rankguard_sim.physics import gpus


def slice_doc(**endpoints: dict[str, Any]) -> dict[str, Any]:
    """An EndpointSlice of the headless Service `llm-group` in `team-a`, as the
    EndpointSlice controller writes it (its Service in the kubernetes.io/service-name label)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "llm-group-x7k2p",
            "namespace": "team-a",
            "uid": "5a3c",
            "labels": {
                "kubernetes.io/service-name": "llm-group",
                "endpointslice.kubernetes.io/managed-by": "x",
            },
        },
        "addressType": "IPv4",
        "endpoints": list(endpoints.values()),
        "ports": [{"name": "", "port": None, "protocol": "TCP"}],
    }


def endpoint(ip: str, hostname: str | None, ready: bool | None = True) -> dict[str, Any]:
    doc: dict[str, Any] = {"addresses": [ip], "targetRef": {"kind": "Pod", "name": hostname or "x"}}
    if hostname is not None:
        doc["hostname"] = hostname
    if ready is not None:
        doc["conditions"] = {"ready": ready, "serving": ready, "terminating": False}
    return doc


def test_a_pod_with_a_hostname_resolves_by_its_three_cluster_names(tmp_path: Path) -> None:
    doc = slice_doc(
        leader=endpoint("127.0.0.5", "llm-0"),
        worker=endpoint("127.0.0.6", "llm-0-1"),
        unnamed=endpoint("127.0.0.7", None),  # no spec.hostname/subdomain: no name
        not_ready=endpoint("127.0.0.8", "llm-1", ready=False),  # CoreDNS leaves it out
        unknown=endpoint("127.0.0.9", "llm-2", ready=None),  # no conditions: counted as ready
    )
    assert records(doc)[0] == (
        "127.0.0.5",
        ("llm-0.llm-group.team-a", "llm-0.llm-group.team-a.svc", "llm-0.llm-group.team-a.svc.cluster.local"),
    )
    hosts = tmp_path / "dns" / "hosts"
    write_hosts(hosts, render_hosts([doc]))
    env = {HOSTS_FILE_ENV: str(hosts)}
    assert resolve("llm-0.llm-group.team-a", env) == "127.0.0.5"
    assert resolve("llm-0.llm-group.team-a.svc", env) == "127.0.0.5"
    assert resolve("LLM-0.llm-group.team-a.svc.cluster.local.", env) == "127.0.0.5"  # case, root dot
    assert resolve("llm-0-1.llm-group.team-a", env) == "127.0.0.6"
    assert resolve("llm-2.llm-group.team-a", env) == "127.0.0.9"
    assert resolve("llm-1.llm-group.team-a", env) is None
    assert resolve("llm-0.llm-group.team-b", env) is None  # another namespace's
    assert resolve("llm-group.team-a", env) is None  # Service names are not served
    assert "127.0.0.7" not in hosts.read_text()


def test_an_ip_literal_resolves_to_itself_and_nothing_else_without_the_file(tmp_path: Path) -> None:
    assert resolve("10.1.2.3", {}) == "10.1.2.3"
    assert resolve("::1", {}) == "::1"
    assert resolve("llm-0.llm-group.team-a", {}) is None
    assert resolve("llm-0.llm-group.team-a", {HOSTS_FILE_ENV: str(tmp_path / "missing")}) is None


@pytest.mark.parametrize(
    "broken",
    [
        {"metadata": {"namespace": "team-a"}, "endpoints": [endpoint("127.0.0.5", "llm-0")]},  # no Service
        {
            "metadata": {"labels": {"kubernetes.io/service-name": "s"}},
            "endpoints": [endpoint("1.2.3.4", "a")],
        },
        {"metadata": {"namespace": "n", "labels": {"kubernetes.io/service-name": "s"}}, "endpoints": None},
    ],
)
def test_slices_without_a_service_namespace_or_endpoints_give_no_names(broken: dict[str, Any]) -> None:
    assert records(broken) == []


def test_a_rewrite_replaces_the_whole_file(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    write_hosts(hosts, render_hosts([slice_doc(a=endpoint("127.0.0.5", "llm-0"))]))
    write_hosts(hosts, render_hosts([slice_doc(a=endpoint("127.0.0.9", "llm-0"))]))  # the pod moved
    assert resolve("llm-0.llm-group.team-a", {HOSTS_FILE_ENV: str(hosts)}) == "127.0.0.9"
    assert [p.name for p in tmp_path.iterdir()] == ["hosts"]  # no temporary file left behind


def pod(
    name: str, ip: str, *, ready: bool, labels: dict[str, str] | None = None, **spec: str
) -> dict[str, Any]:
    status = "True" if ready else "False"
    return {
        "metadata": {"name": name, "namespace": "team-a", "uid": name, "labels": labels or {"group": "llm"}},
        "spec": {"hostname": name, "subdomain": "llm-group", **spec},
        "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": status}]},
    }


def service(publish_not_ready: bool, cluster_ip: str = "None", name: str = "llm-group") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team-a", "uid": name},
        "spec": {
            "clusterIP": cluster_ip,
            "selector": {"group": "llm"},
            "publishNotReadyAddresses": publish_not_ready,
        },
    }


def test_the_controllers_rules_give_the_slices_coredns_answers_from(tmp_path: Path) -> None:
    pods = [
        pod("llm-0", "127.0.0.5", ready=False),  # starting: vLLM's leader is not Ready yet
        pod("llm-0-1", "127.0.0.6", ready=True),
        pod("other", "127.0.0.7", ready=True, labels={"group": "else"}),  # not selected
        pod("stray", "127.0.0.8", ready=True, subdomain="another"),  # another subdomain: no hostname
        {**pod("done", "127.0.0.9", ready=True), "status": {"phase": "Succeeded", "podIP": "127.0.0.9"}},
    ]
    hosts = tmp_path / "hosts"
    env = {HOSTS_FILE_ENV: str(hosts)}
    write_hosts(hosts, render_hosts(endpoint_slices([service(publish_not_ready=True)], pods)))
    assert resolve("llm-0.llm-group.team-a", env) == "127.0.0.5"  # published before it is Ready
    assert resolve("llm-0-1.llm-group.team-a.svc.cluster.local", env) == "127.0.0.6"
    assert resolve("other.llm-group.team-a", env) is None
    assert resolve("stray.llm-group.team-a", env) is None and resolve("stray.another.team-a", env) is None
    assert resolve("done.llm-group.team-a", env) is None
    write_hosts(hosts, render_hosts(endpoint_slices([service(publish_not_ready=False)], pods)))
    assert resolve("llm-0.llm-group.team-a", env) is None  # not Ready: CoreDNS leaves it out
    assert resolve("llm-0-1.llm-group.team-a", env) == "127.0.0.6"
    terminating = [
        {**pods[1], "metadata": {**pods[1]["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    ]
    assert records(endpoint_slices([service(publish_not_ready=False)], terminating)[0]) == []
    assert endpoint_slices([service(True, cluster_ip="10.0.0.12")], pods) == []  # not headless


def test_the_kubelet_reads_a_vllm_node_rank_from_the_container_command() -> None:
    launch = ["python3", "/opt/rankguard/agent/rankguard-agent", "launch", "--", "vllm", "serve", "m"]
    assert node_rank([*launch, "--nnodes", "2", "--node-rank", "1", "--headless"]) == 1
    assert node_rank([*launch, "--node-rank=3"]) == 3
    assert node_rank([*launch, "-r", "2"]) == 2
    assert node_rank(launch) == 0
    assert node_rank(["python3", "-r", "5"]) == 0  # not a vllm serve command line
    assert node_rank([*launch, "--node-rank", "$(RANKGUARD_NODE_RANK)"]) == 0  # unexpanded


def test_a_headless_pods_gpus_get_their_global_ranks_communicator_cost(tmp_path: Path) -> None:
    """tp8-nvls' rank 0 pays NCCL's root skew: node 1's first GPU (global rank 8) must not."""
    node = NodeGpus(tmp_path, 16, None, "llama3-70b-tp8-nvls")
    node.create(seed="n")
    assert node.scenario is not None
    leader, worker = node.uuids[:8], node.uuids[8:]
    node.set_comm_init(leader, ["vllm", "serve", "m", "--node-rank", "0"])
    node.set_comm_init(worker, ["vllm", "serve", "m", "--node-rank", "1"])
    assert gpus.read_device(tmp_path, leader[0]).comm_init_bytes == node.scenario.comm_init_bytes(0)
    assert gpus.read_device(tmp_path, worker[0]).comm_init_bytes == node.scenario.comm_init_bytes(8)
    assert node.scenario.comm_init_bytes(0) > node.scenario.comm_init_bytes(8)
