"""surroundings.node_gpu: the nodes' labels while a labelled pod runs, status.nodeGpu while none
does, for the same resource only; the spec's size wins over both."""

from __future__ import annotations

import copy

from rankguard_operator.core.budget.gpu_labels import NodeGpu
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.step import World
from rankguard_operator.core.step.surroundings import node_gpu
from rankguard_operator.core.units import GiB, MiB

SPEC = {"model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "image": "vllm/vllm-openai:v0.33.0"}
LABELS = {"node-a": {"nvidia.com/gpu.memory": "81559"}}
KEPT = NodeGpu(40960 * MiB, False, "node-b", "nvidia.com/gpu")


def _world(labels: dict[str, dict[str, str]]) -> World:
    return World(
        name="svc", namespace="ns", uid="u", generation=1, spec=SPEC, now=0.0, new_id="r", node_labels=labels
    )


def test_the_labels_of_the_pods_nodes_win_and_status_stands_in_when_no_pod_runs() -> None:
    spec = parse_spec(copy.deepcopy(SPEC))
    assert node_gpu(_world(LABELS), spec, KEPT) == NodeGpu(81559 * MiB, False, "node-a", "nvidia.com/gpu")
    assert node_gpu(_world({}), spec, KEPT) == KEPT
    assert node_gpu(_world({}), spec, None) is None


def test_a_kept_size_of_another_resource_is_not_used() -> None:
    spec = parse_spec({**copy.deepcopy(SPEC), "resources": {"gpuResourceName": "nvidia.com/mig-3g.40gb"}})
    assert node_gpu(_world({}), spec, KEPT) is None


def test_the_specs_size_wins_over_labels_and_status() -> None:
    spec = parse_spec({**copy.deepcopy(SPEC), "memory": {"gpuMemoryBytes": 80 * GiB}})
    assert node_gpu(_world(LABELS), spec, KEPT) is None
