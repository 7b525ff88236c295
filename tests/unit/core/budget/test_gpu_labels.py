"""One GPU's size from the node's GPU Feature Discovery labels (core/budget/gpu_labels), and how the
step plans with it: before any agent measured the GPU, and for a MIG slice over what the
agents' NVML totals say (they may be the parent GPU's).

The label sets are the ones NVIDIA/k8s-device-plugin's own tests expect
(internal/lm/mig-strategy_test.go): full GPU, MIG `single` (slices handed out as
nvidia.com/gpu) and MIG `mixed` (nvidia.com/mig-<profile>)."""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Any

import kopf
import pytest

from rankguard_agent.wire.report import Report
from rankguard_operator.core.budget.bounds import measured_plan, prior_plan
from rankguard_operator.core.budget.gpu_labels import (
    NodeGpu,
    gpu_from_nodes,
    node_gpu_memory,
    planning_gpu_bytes,
    slice_bytes,
)
from rankguard_operator.core.observe.headroom import aggregate, gpu_totals
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.step import Step, needs, reconcile
from rankguard_operator.core.units import GiB, MiB
from rankguard_operator.edge import k8s
from rankguard_operator.edge.reads import NodeLabels
from tests.unit.reconcile_world import SETTINGS, SPEC, Cluster, flags_of, report, vllm_argv

H100_MIB = 81559  # nvidia.com/gpu.memory of an H100 80GB HBM3 (NVML total / MiB)
FULL_GPU = {
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.memory": str(H100_MIB),
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
}
MIXED = {
    "nvidia.com/mig.strategy": "mixed",
    "nvidia.com/gpu.memory": str(H100_MIB),  # the parent GPU's, under the mixed strategy
    "nvidia.com/mig-3g.40gb.count": "2",
    "nvidia.com/mig-3g.40gb.memory": "40192",
    "nvidia.com/mig-1g.10gb.memory": "9728",
}
SINGLE = {
    "nvidia.com/mig.strategy": "single",
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
    "nvidia.com/gpu.memory": "4864",
}


# --------------------------------------------------------------------------------------------
# The labels


def test_a_full_gpu_is_its_gpu_memory_label_in_mib() -> None:
    assert node_gpu_memory(FULL_GPU, "nvidia.com/gpu") == NodeGpu(H100_MIB * MiB, False, "", "nvidia.com/gpu")


def test_a_mig_profile_under_the_mixed_strategy_is_its_own_label_not_the_parents() -> None:
    got = node_gpu_memory(MIXED, "nvidia.com/mig-3g.40gb", "n1")
    assert got == NodeGpu(40192 * MiB, mig=True, node="n1", resource="nvidia.com/mig-3g.40gb")
    assert node_gpu_memory(MIXED, "nvidia.com/mig-2g.20gb") is None  # a profile the node lacks


def test_the_single_strategy_labels_the_slice_as_nvidia_com_gpu_and_it_counts_as_mig() -> None:
    assert node_gpu_memory(SINGLE, "nvidia.com/gpu") == NodeGpu(4864 * MiB, True, "", "nvidia.com/gpu")


def test_labels_that_do_not_state_a_size_give_nothing() -> None:
    invalid_single = {**SINGLE, "nvidia.com/gpu.product": "A100-MIG-INVALID", "nvidia.com/gpu.memory": "0"}
    for labels in ({}, invalid_single, {"nvidia.com/gpu.memory": "80GB"}, {"nvidia.com/gpu.memory": "-1"}):
        assert node_gpu_memory(labels, "nvidia.com/gpu") is None, labels
    # GFD's convention is NVIDIA's: another vendor's `.memory` label is not read as MiB
    assert node_gpu_memory({"amd.com/gpu.memory": "65536"}, "amd.com/gpu") is None


def test_a_mixed_pool_plans_for_its_smallest_node() -> None:
    small = {**FULL_GPU, "nvidia.com/gpu.memory": "40960"}
    got = gpu_from_nodes({"big": FULL_GPU, "small": small, "bare": {}}, "nvidia.com/gpu")
    assert got == NodeGpu(40960 * MiB, mig=False, node="small", resource="nvidia.com/gpu")
    assert gpu_from_nodes({"bare": {}}, "nvidia.com/gpu") is None


def test_the_agents_figure_wins_for_a_full_gpu_and_the_label_for_a_slice() -> None:
    full, mig = NodeGpu(H100_MIB * MiB, mig=False), NodeGpu(40192 * MiB, mig=True)
    assert planning_gpu_bytes(None, None) is None
    assert planning_gpu_bytes(None, full) == full.bytes  # nothing measured yet: the label
    assert planning_gpu_bytes(70 * GiB, full) == 70 * GiB  # another card than the label says
    # the same card, measured to the byte: the label's figure stays (nothing re-renders)
    assert planning_gpu_bytes(full.bytes + 123_456, full) == full.bytes
    assert planning_gpu_bytes(80 * GiB, mig) == mig.bytes  # NVML's parent total never wins
    assert slice_bytes(mig) == mig.bytes and slice_bytes(full) is None and slice_bytes(None) is None


def test_the_edge_reads_the_nodes_of_scheduled_pods_only_when_the_spec_lacks_the_size() -> None:
    pods: list[dict[str, Any]] = [
        {"metadata": {"name": "a"}, "spec": {"nodeName": "n2"}},
        {"metadata": {"name": "b"}, "spec": {"nodeName": "n1"}},
        {"metadata": {"name": "c"}, "spec": {}},  # not scheduled yet
        {"metadata": {"name": "d"}, "spec": {"nodeName": "n1"}},
    ]
    no_size = {k: v for k, v in SPEC.items() if k != "memory"}
    assert needs(no_size, "svc", deployment=None, pods=pods).nodes == ("n1", "n2")
    assert (
        needs(SPEC, "svc", deployment=None, pods=pods).nodes == ()
    )  # spec.memory.gpuMemoryBytes wins: nothing to read
    assert (
        needs({"model": {}}, "svc", deployment=None, pods=pods).nodes == ()
    )  # unreadable spec: the step says why


# --------------------------------------------------------------------------------------------
# The step plans with them


def _run(c: Cluster, nodes: dict[str, dict[str, str]], reports: tuple[Any, ...] = ()) -> Step:
    world = replace(c.world(reports), node_labels=copy.deepcopy(nodes))
    step = reconcile.step(c.state(), world, SETTINGS)
    for effect in step.effects:
        c.carry_out(effect)
    c.clock += 2.0
    return step


def _no_size() -> Cluster:
    c = Cluster()
    del c.spec["memory"]
    return c


def test_before_any_agent_reports_the_first_budget_is_planned_from_the_nodes_label() -> None:
    without = _no_size()
    _run(without, {})
    assert without.deployment is not None
    assert "--kv-cache-memory-bytes" not in vllm_argv(without.deployment)  # no size, no plan

    c = _no_size()
    _run(c, {"gpu-1": FULL_GPU})
    assert c.deployment is not None
    want = prior_plan(parse_spec({**c.spec, "memory": {"gpuMemoryBytes": H100_MIB * MiB}}))
    assert want is not None
    assert flags_of(c.deployment).kv_cache_memory_bytes == want.kv_cache_memory_bytes
    assert "gpuMemoryBytes" not in c.status  # status keeps what the agents measured, not labels


def test_the_spec_size_wins_over_the_nodes_label() -> None:
    c = Cluster()  # spec.memory.gpuMemoryBytes: 80 GiB
    _run(c, {"gpu-1": {**FULL_GPU, "nvidia.com/gpu.memory": "40960"}})
    assert c.deployment is not None
    want = prior_plan(parse_spec(c.spec))
    assert want is not None and flags_of(c.deployment).kv_cache_memory_bytes == want.kv_cache_memory_bytes


def _parent_gpu_report(at: float) -> Report:
    """What an agent whose NVML sees the parent GPU reports from a 3g.40gb slice: 80 GiB."""
    return report((20 * GiB, 20 * GiB), at)


def test_a_mig_slice_is_planned_with_its_label_even_after_agents_report_the_parent_gpu() -> None:
    c = _no_size()
    c.spec["resources"] = {"gpuResourceName": "nvidia.com/mig-3g.40gb"}
    _run(c, {"gpu-1": MIXED})
    assert c.deployment is not None
    spec = parse_spec(c.spec)
    sliced = prior_plan(parse_spec({**c.spec, "memory": {"gpuMemoryBytes": 40192 * MiB}}))
    assert sliced is not None
    first, argv = flags_of(c.deployment).kv_cache_memory_bytes, vllm_argv(c.deployment)
    assert first == sliced.kv_cache_memory_bytes
    c.controller_done()
    name = c.pods[0]["metadata"]["name"]
    for _ in range(3):
        _run(c, {"gpu-1": MIXED}, ((name, _parent_gpu_report(c.clock), c.clock),))
    # the agents' figure is kept as measured, but the plans stand on the slice's size
    assert c.status["gpuMemoryBytes"] == 80 * GiB
    assert flags_of(c.deployment).kv_cache_memory_bytes == first
    assert vllm_argv(c.deployment) == argv  # the start-up utilisation is still the slice's share
    obs = aggregate([(name, _parent_gpu_report(c.clock), c.clock)], c.clock, 30.0)
    plan = measured_plan(spec, gpu_totals(obs), learned_gpu_bytes=80 * GiB, slice_bytes=40192 * MiB)
    parent = measured_plan(spec, gpu_totals(obs), learned_gpu_bytes=80 * GiB)
    assert plan is not None and parent is not None
    assert {r.total_bytes for r in plan.ranks} == {40192 * MiB}
    assert {r.total_bytes for r in parent.ranks} == {80 * GiB}
    assert plan.kv_cache_memory_bytes < parent.kv_cache_memory_bytes


# --------------------------------------------------------------------------------------------
# The edge: one Node read per node and period, and a namespaced install carries on without


class FakeNodes:
    """The API's answers to `k8s.get_node`, by node name (the API call itself is the edge's)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers: dict[str, Any] = answers
        self.calls: list[str] = []

    async def get_node(self, name: str) -> dict[str, Any] | None:
        self.calls.append(name)
        answer = self.answers[name]
        if isinstance(answer, Exception):
            raise answer
        return {"metadata": {"name": name, "labels": answer}}


async def test_node_labels_are_read_once_per_period_and_errors_never_stop_a_pass(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeNodes({"n1": FULL_GPU, "n2": kopf.TemporaryError("HTTP 500", delay=1)})
    monkeypatch.setattr(k8s, "get_node", fake.get_node)
    nodes = NodeLabels()
    assert await nodes.labels(("n1", "n2")) == {"n1": FULL_GPU}
    assert await nodes.labels(("n1",)) == {"n1": FULL_GPU}
    assert fake.calls == ["n1", "n2"]  # n1 is kept for the period: not read again

    fake.answers["n3"] = k8s.NodeForbidden("nodes is forbidden")
    monkeypatch.setattr(NodeLabels, "forbidden_logged", False)
    with caplog.at_level(logging.WARNING, logger="rankguard_operator.executor"):
        assert await nodes.labels(("n3", "n4")) == {}
        assert await NodeLabels().labels(("n3",)) == {}  # another service: no second log line
    assert fake.calls == ["n1", "n2", "n3", "n3"]  # after a 403, n4 is not even tried
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["cannot read Node n3"]


def test_what_the_labels_said_is_kept_in_status_and_a_bad_copy_is_nothing() -> None:
    got = gpu_from_nodes({"n1": MIXED}, "nvidia.com/mig-3g.40gb")
    assert got is not None and NodeGpu.from_status(got.to_status()) == got
    good = got.to_status()
    for bad in (
        None,
        "x",
        {},
        {**good, "bytes": "1"},
        {**good, "bytes": True},
        {**good, "bytes": 0},
        {**good, "mig": "no"},
        {**good, "resource": 3},
    ):
        assert NodeGpu.from_status(bad) is None, bad
