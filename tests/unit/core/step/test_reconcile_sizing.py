"""Across modules: `reconcile.step` with an engine that measures its own KV cache (vLLM 0.34):
no byte budget rendered, the mode in status, one roll when an image crosses 0.34 (each way), and
a CUDA OOM beside a neighbour answered with a reserve that names it."""

from __future__ import annotations

from dataclasses import replace

from rankguard_agent.wire.report_memory import OtherProcess
from rankguard_operator.core.units import GiB
from tests.unit.reconcile_world import (
    Cluster,
    crash_the_pod,
    flags_of,
    report,
    running,
    vllm_argv,
)

V34 = "vllm/vllm-openai:v0.34.0"


def started(image: str = V34) -> Cluster:
    c = Cluster()
    c.spec["image"] = image
    c.run()
    c.controller_done()
    c.run()
    return c


def test_a_0_34_service_leaves_the_sizing_to_the_engine() -> None:
    c = started()
    assert c.deployment is not None
    argv = vllm_argv(c.deployment)
    assert "--kv-cache-memory-bytes" not in argv
    assert "--gpu-memory-utilization" not in argv  # nothing to reserve: vLLM's own 1.0
    assert flags_of(c.deployment).engine_measured
    assert c.status["sizing"]["mode"] == "engine-measured"
    assert c.status["sizing"]["reason"] == "EngineMeasures"
    assert c.status["kvBudget"] == "measured"
    assert c.status["budget"]["source"] == "engine-measured"


def test_a_0_33_service_stays_pinned_and_says_why() -> None:
    c = running()
    assert c.status["sizing"]["mode"] == "pinned"
    assert c.status["sizing"]["reason"] == "EngineEstimates"
    assert c.deployment is not None and "--kv-cache-memory-bytes" in vllm_argv(c.deployment)


def test_an_image_crossing_0_34_rolls_once_each_way() -> None:
    c = running()
    before = len(c.deployments_applied)
    c.spec["image"] = V34
    c.generation += 1
    for _ in range(3):
        c.run()
        c.controller_done()
    assert len(c.deployments_applied) == before + 1
    assert c.deployment is not None and flags_of(c.deployment).engine_measured
    c.spec["image"] = "vllm/vllm-openai:v0.33.0"
    c.generation += 1
    for _ in range(3):
        c.run()
        c.controller_done()
    assert len(c.deployments_applied) == before + 2
    assert "--kv-cache-memory-bytes" in vllm_argv(c.deployment)


def test_a_neighbour_s_oom_raises_the_reserve_once_and_names_it() -> None:
    c = started()
    pod_name = c.pods[0]["metadata"]["name"]
    r = report((20 * GiB, 20 * GiB), c.clock)
    trainer = OtherProcess(4242, "trainer", 6 * GiB)
    r = replace(
        r,
        ranks=[
            replace(r.ranks[0], others_bytes=6 * GiB, others_peak_bytes=6 * GiB, others=[trainer]),
            r.ranks[1],
        ],
    )
    c.run(reports=((pod_name, r, c.clock),))
    before = len(c.deployments_applied)
    crash_the_pod(c)
    step = c.run(reports=((pod_name, r, c.clock),))
    assert len(c.deployments_applied) == before + 1
    assert c.deployment is not None
    argv = vllm_argv(c.deployment)
    assert "--kv-cache-memory-bytes" not in argv
    util = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert 80 * GiB * (1 - util) >= 6 * GiB
    said = [e for e in step.effects if type(e).__name__ == "PostEvent"]
    assert any(e.reason == "RaiseReserve" and "pid 4242 (trainer)" in e.message for e in said)  # type: ignore[attr-defined]
    assert c.status["sizing"]["reserve"].startswith(f"gpu-memory-utilization {util:g}")
