"""A simulated node's GPU labels (NVIDIA GPU Feature Discovery's) and its MIG slices, offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankguard_sim.kubelet.nodegpus import MigLayout, NodeGpus, profile_slices
from rankguard_sim.kubelet.nodes import gfd_labels, label_value, node_status
from rankguard_sim.kubelet.pod.spec import pod_gpu_count, pod_mig_counts
from rankguard_sim.physics import gpus as simgpus

GIB, MIB = 1 << 30, 1 << 20


def test_full_gpu_labels_are_gfds_names_and_units() -> None:
    labels = gfd_labels("NVIDIA A100-SXM4-80GB", 85_899_345_920, 8)
    assert labels == {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.memory": "81920",  # MiB
    }
    assert label_value("NVIDIA H100 80GB HBM3 (simulated)") == "NVIDIA-H100-80GB-HBM3--simulated"


def test_mig_mixed_strategy_labels_each_profile() -> None:
    labels = gfd_labels("NVIDIA A100-SXM4-80GB", 80 * GIB, 2, [("3g.40gb", 2, 40 * GIB, 3)])
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/gpu.memory"] == str(80 * 1024)  # the parent GPU's
    mig = {k.removeprefix("nvidia.com/mig-3g.40gb."): v for k, v in labels.items() if "mig-3g" in k}
    assert mig == {
        "product": "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb",
        "count": "2",
        "replicas": "1",
        "memory": str(40 * 1024),
        "slices.gi": "3",
        "slices.ci": "3",
    }


def test_profiles_and_their_memory() -> None:
    assert profile_slices("3g.40gb") == (3, 40)
    assert profile_slices("1g.10gb.me") == (1, 10)
    with pytest.raises(ValueError, match="not a MIG profile"):
        MigLayout(1, {"big": 1})
    a100 = round(79.14 * GIB)
    layout = MigLayout(gpus=2, profiles={"3g.40gb": 2, "1g.10gb": 1})
    assert layout.slice_bytes("3g.40gb", a100) == a100 * 40 // 80
    assert layout.slice_bytes("1g.10gb", a100) == a100 * 10 // 80
    assert MigLayout(1, {"3g.40gb": 1}, memory={"3g.40gb": 123}).slice_bytes("3g.40gb", a100) == 123
    assert layout.slices() == {"3g.40gb": 4, "1g.10gb": 2}


def test_a_node_with_mig_slices_hands_them_out_like_gpus(tmp_path: Path) -> None:
    node = NodeGpus(tmp_path, 2, None, "llama3-70b-tp4", MigLayout(gpus=1, profiles={"3g.40gb": 2}))
    node.create(seed="n1")
    assert node.mig_resources() == {"nvidia.com/mig-3g.40gb": "2"}
    slices = node.slices["nvidia.com/mig-3g.40gb"]
    assert all(u.startswith("MIG-") for u in slices)
    device = simgpus.read_device(tmp_path, slices[0])
    assert device.total_bytes == node.total_bytes * 40 // 80
    assert device.name == "NVIDIA A100-SXM4-80GB MIG 3g.40gb (simulated)"
    labels = node.node_labels()
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert labels["nvidia.com/gpu.count"] == "3"  # two whole GPUs and the MIG-enabled one
    assert labels["nvidia.com/mig-3g.40gb.memory"] == str(device.total_bytes // MIB)

    assert node.acquire_slices("pod-a", {"nvidia.com/mig-3g.40gb": 1}) == {
        "nvidia.com/mig-3g.40gb": slices[:1]
    }
    assert node.acquire_slices("pod-b", {"nvidia.com/mig-3g.40gb": 2}) is None  # all or nothing
    assert node.free_slices("nvidia.com/mig-3g.40gb") == slices[1:]
    assert node.acquire(uid="pod-b", count=2) == node.uuids  # whole GPUs are apart from slices
    node.release("pod-a")
    assert node.free_slices("nvidia.com/mig-3g.40gb") == slices


def test_a_node_without_mig_is_as_before(tmp_path: Path) -> None:
    node = NodeGpus(tmp_path, 4, None, None)
    node.create(seed="n2")
    assert node.mig_resources() == {}
    assert node.node_labels()["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert "nvidia.com/mig.strategy" not in node.node_labels()
    status = node_status(4, "1Gi", "1", "127.0.0.1", {"nvidia.com/mig-3g.40gb": "2"})
    assert (
        status["capacity"]["nvidia.com/mig-3g.40gb"] == "2" == status["allocatable"]["nvidia.com/mig-3g.40gb"]
    )


def test_a_pod_s_mig_slices_per_resource() -> None:
    pod = {
        "spec": {
            "initContainers": [{"name": "i", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}}],
            "containers": [
                {"name": "a", "resources": {"limits": {"nvidia.com/mig-3g.40gb": "1", "memory": "1Gi"}}},
                {"name": "b", "resources": {"requests": {"nvidia.com/mig-1g.10gb": "2"}}},
                {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
            ],
        }
    }
    assert pod_mig_counts(pod) == {"nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": 1}
    assert pod_gpu_count(pod) == 1
    assert pod_mig_counts({"spec": {"containers": [{"name": "x"}]}}) == {}


def test_a_node_without_vmm_says_so_on_every_device(tmp_path: Path) -> None:
    layout = MigLayout(gpus=1, profiles={"3g.40gb": 1})
    node = NodeGpus(tmp_path, 2, None, None, layout, vmm=False)
    node.create(seed="old-driver")
    devices = simgpus.list_gpus(tmp_path)
    assert len(devices) == 3 and not any(d.vmm for d in devices)  # whole GPUs and MIG slices alike
    fresh = NodeGpus(tmp_path / "new", 1, None, None)
    fresh.create(seed="new-driver")
    assert simgpus.read_device(tmp_path / "new", fresh.uuids[0]).vmm


def test_a_neighbour_on_a_node_gpu_lives_until_the_node_stops_it(tmp_path: Path) -> None:
    node = NodeGpus(tmp_path, 2, None, None)
    node.create(seed="n")
    first = node.start_neighbour(1, 3 << 30)
    second = node.start_neighbour(node.uuids[0], 1 << 30)
    assert simgpus.process_bytes(tmp_path, node.uuids[1], first.pid) == 3 << 30
    assert simgpus.used_bytes(tmp_path, node.uuids[0]) == 1 << 30
    node.stop_neighbours()
    assert first.proc.poll() is not None and second.proc.poll() is not None
    assert simgpus.used_bytes(tmp_path, node.uuids[1]) == 0 and node.neighbours == []
