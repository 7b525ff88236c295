"""One GPU's memory as the node's GPU Feature Discovery (GFD) labels state it.

Before any agent has measured the GPU (status.gpuMemoryBytes) and without
spec.memory.gpuMemoryBytes, the plans can still stand on what the node says about its GPUs.
NVIDIA's GFD (now part of NVIDIA/k8s-device-plugin) labels each node, per extended resource
`R`, with `R.memory` in MiB:

* Full GPUs, `nvidia.com/gpu.memory` = NVML's total / (1024 * 1024)
  (internal/lm/resource.go, NewGPUResourceLabeler; internal/resource/nvml-device.go,
  GetTotalMemoryMB divides `info.Total` by 1024 * 1024, so the "MB" is MiB).
* MIG, `mixed` strategy: each profile is its own resource `nvidia.com/mig-<profile>`
  (e.g. nvidia.com/mig-3g.40gb) with `nvidia.com/mig-<profile>.memory` = the slice's
  `MemorySizeMB` attribute (internal/lm/mig-strategy.go, newMigStrategyMixedLabeler;
  internal/resource/nvml-mig-device.go, GetAttributes). `nvidia.com/gpu.memory` is then the
  parent GPU's, which is not what a pod asking for a slice gets.
* MIG, `single` strategy: the slices are handed out as `nvidia.com/gpu` itself, labelled
  `nvidia.com/mig.strategy=single`, `nvidia.com/gpu.product=<model>-MIG-<profile>` and
  `nvidia.com/gpu.memory` = the slice's memory; an invalid layout is labelled
  `<model>-MIG-INVALID` with memory 0 (newMigStrategySingleLabeler,
  newInvalidMigStrategyLabeler; internal/lm/mig-strategy_test.go shows the label sets).

A MIG slice's label is its real size, while the agent's NVML total may be the parent GPU's
(NVML's device handles enumerate physical GPUs): for a slice the label wins over what the
agents measured (`planning_gpu_bytes`, `NodeGpu.mig`).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rankguard_operator.core.units import MiB

NVIDIA_PREFIX = "nvidia.com/"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
FULL_GPU_RESOURCE = "nvidia.com/gpu"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
PRODUCT_LABEL = "nvidia.com/gpu.product"
_MAX_MIB = 1 << 24  # 16 TiB: no GPU has more; a larger label value is not a GPU's memory


@dataclass(frozen=True)
class NodeGpu:
    """One GPU's (or MIG slice's) memory as a node's labels state it."""

    bytes: int
    mig: bool  # a MIG slice: the label is the slice's size, the agents' NVML total may not be
    node: str = ""
    resource: str = ""  # the extended resource it is the size of (spec.resources.gpuResourceName)

    def to_status(self) -> dict[str, object]:
        """status.nodeGpu: kept so a render does not lose it while no pod runs."""
        return {"bytes": self.bytes, "mig": self.mig, "node": self.node, "resource": self.resource}

    @classmethod
    def from_status(cls, doc: object) -> NodeGpu | None:
        """status.nodeGpu as stored; None when absent or not what `to_status` writes."""
        if not isinstance(doc, Mapping):
            return None
        size, mig, node, resource = doc.get("bytes"), doc.get("mig"), doc.get("node", ""), doc.get("resource")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= _MAX_MIB * MiB:
            return None
        if not isinstance(mig, bool) or not isinstance(node, str) or not isinstance(resource, str):
            return None
        return cls(size, mig, node, resource)


def _mib(value: object) -> int | None:
    if not isinstance(value, str) or not value.isdigit():
        return None
    n = int(value)
    return n if 0 < n <= _MAX_MIB else None


def node_gpu_memory(labels: Mapping[str, str], resource: str, node: str = "") -> NodeGpu | None:
    """The memory of one unit of `resource` (spec.resources.gpuResourceName) on a node with
    these labels, or None when its labels do not say (no GFD, another vendor, an invalid MIG
    layout labelled 0)."""
    if not resource.startswith(NVIDIA_PREFIX):
        return None  # GFD's convention; another vendor's `.memory` label may mean something else
    mib = _mib(labels.get(f"{resource}.memory"))
    if mib is None:
        return None
    mig = resource.startswith(MIG_RESOURCE_PREFIX) or (
        resource == FULL_GPU_RESOURCE
        and labels.get(MIG_STRATEGY_LABEL) == "single"
        and "-MIG-" in labels.get(PRODUCT_LABEL, "")
    )
    return NodeGpu(mib * MiB, mig, node, resource)


def gpu_from_nodes(nodes: Mapping[str, Mapping[str, str]], resource: str) -> NodeGpu | None:
    """The smallest GPU the serving pods' nodes state (a mixed pool plans for its smallest
    card, as `observe.headroom.learned_gpu_bytes` does with the agents' totals); None when none says."""
    found = [g for name, labels in sorted(nodes.items()) if (g := node_gpu_memory(labels, resource, name))]
    if not found:
        return None
    return min(found, key=lambda g: (g.bytes, g.node))


def slice_bytes(node: NodeGpu | None) -> int | None:
    """A MIG slice's size, which replaces the agents' totals in the measured plan; None for a
    full GPU (the agents' NVML totals are the truth there) or without a label."""
    return node.bytes if node is not None and node.mig else None


def planning_gpu_bytes(learned: int | None, node: NodeGpu | None) -> int | None:
    """One GPU's size for the plans where spec.memory.gpuMemoryBytes is unset (the spec's value
    wins over both, `budget.bounds.prior_plan`). `learned` is what the agents measured
    (status.gpuMemoryBytes).

    * No label: the agents' figure (or nothing yet).
    * A MIG slice: the label, always: NVML in the pod may report the parent GPU's total.
    * A full GPU: the agents' figure once there is one, the label before. The label is NVML's
      total floored to whole MiB, so when the agents' figure is the same GPU (within that MiB)
      the label's figure is kept: plans stand on one number and nothing re-renders for a
      rounding difference.
    """
    if node is None:
        return learned
    if learned is None or node.mig:
        return node.bytes
    if node.bytes <= learned < node.bytes + MiB:
        return node.bytes
    return learned
