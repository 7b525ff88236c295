"""Fail loudly, and once (DESIGN §7; issue 13, point 5): every state in which an LLMService
cannot serve shows a condition a person understands, says it in one Event per change (not per
pass), and an impossible spec is refused before anything is deployed. One test per case the
sandbox's fault drills found, against the pure step (`reconcile.step`) in the in-memory cluster.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.effects import ApplyDeployment, Effect, PostEvent, WriteStatus
from rankguard_operator.core.observe.blockers import UNSCHEDULABLE_AFTER_SECONDS
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.step import Step, reconcile
from rankguard_operator.core.units import GiB, MiB, parse_iso
from tests.unit.reconcile_world import (
    SETTINGS,
    SPEC,
    Cluster,
    crash_loop,
    cuda_oom_record,
    engine_error_record,
    flags_of,
    kv_too_small_record,
    running,
)


def degraded(c: Cluster) -> dict[str, Any]:
    return next(x for x in c.status["conditions"] if x["type"] == "Degraded")


def events(steps: list[Step], reason: str) -> list[PostEvent]:
    """The Events of `reason` the steps asked for (what the edge would post, before throttling)."""
    return [e for s in steps for e in s.effects if isinstance(e, PostEvent) and e.reason == reason]


def writes(step: Step) -> list[Effect]:
    return [e for e in step.effects if isinstance(e, (WriteStatus, ApplyDeployment))]


# --------------------------------------------------------------------------------------------
# 1. An engine that keeps failing for a reason that is not memory


def test_an_engine_error_that_repeats_is_a_crash_loop_said_once_with_the_engines_words() -> None:
    c = running()
    applies = len(c.deployments_applied)
    line = "ValueError: unrecognized arguments: --enable-frobnication"
    steps = []
    crash_loop(c, engine_error_record(f"Traceback (most recent call last):\n  ...\n{line}"), run=0)
    steps.append(c.run())
    # the first failure may be a one-off: said once, not Degraded yet
    assert degraded(c)["status"] == "False"
    assert len(events(steps, "EngineError")) == 1 and line in events(steps, "EngineError")[0].message
    for run in range(1, 5):
        crash_loop(c, engine_error_record(line), run=run)
        steps.append(c.run())
        steps.append(c.run())  # a pass between crashes: the pod is in back-off
        d = degraded(c)
        assert (d["status"], d["reason"]) == ("True", "EngineCrashLoop"), d
        assert c.status["phase"] == "Degraded"
    message = degraded(c)["message"]
    assert line in message and "spec.engine.extraArgs" in message and "roll back" in message
    # one Event for the crash loop, however many runs ended; nothing rolled; no Stable/NoFreshData noise
    said = events(steps, "EngineCrashLoop")
    assert len(said) == 1 and line in said[0].message
    assert len(c.deployments_applied) == applies
    assert not events(steps, "NoFreshData") and not events(steps, "Stable")
    # a pass over the same world writes nothing more
    c.clock -= 2.0
    again = reconcile.step(c.state(), c.world(), SETTINGS)
    assert writes(again) == [] and events([again], "EngineCrashLoop") == []


def test_a_sigkilled_launcher_is_said_as_killed_not_as_the_agents_last_log_line() -> None:
    # issue 50: exit 137 with no message of the launcher's own; the kubelet's log tail ends
    # with the agent's last line, which was quoted as the engine's error
    c = running()
    agent_line = "rankguard-agent INFO serving /report on :9400"
    killed = {
        "exitCode": 137,
        "reason": "Error",
        "message": agent_line + "\n",
        "finishedAt": "2027-01-15T08:00:00Z",
    }
    steps = []
    for run in range(3):
        crash_loop(c, killed, run=run)
        steps.append(c.run())
    said = [*events(steps, "EngineError"), *events(steps, "EngineCrashLoop")]
    assert said and all("killed by SIGKILL (exit 137)" in e.message for e in said), said
    assert not any(agent_line in e.message for e in said)
    d = degraded(c)
    assert d["reason"] == "EngineCrashLoop" and "was killed by SIGKILL (exit 137)" in d["message"], d
    assert agent_line not in d["message"]


def test_the_engines_error_line_is_bounded_in_the_condition() -> None:
    c = running()
    long_line = "RuntimeError: " + "x" * 3000  # fits the 4 KiB termination message
    for run in range(2):
        crash_loop(c, engine_error_record(long_line), run=run)
        c.run()
    d = degraded(c)
    assert d["reason"] == "EngineCrashLoop"
    assert "x" * 280 in d["message"] and "x" * 300 not in d["message"]
    assert len(d["message"]) < 1200


def test_the_root_cause_of_a_failed_vllm_start_is_quoted_without_log_prefixes() -> None:
    """vLLM ends a failed start with "Engine core initialization failed. See root cause above."
    after the root cause; the agent joins the lines with " | "."""
    prefix = "(EngineCore_DP0 pid=8238) ERROR 12-01 12:51:46 [core.py:779] "
    detail = " | ".join(
        [
            f"{prefix}    self._init_executor()",
            f"{prefix}RuntimeError: tokenizer.json is corrupt",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
        ]
    )
    c = running()
    for run in range(2):
        crash_loop(c, engine_error_record(detail), run=run)
        c.run()
    message = degraded(c)["message"]
    said = '"RuntimeError: tokenizer.json is corrupt | RuntimeError: Engine core initialization failed.'
    assert said in message
    assert "pid=8238" not in message and "_init_executor" not in message


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--enable-frobnication"], "has no option --enable-frobnication"),
        (["--config", "/etc/vllm/serve.yaml"], "a config file can set options rankguard manages"),
        (["--config=/etc/vllm/serve.yaml"], "a config file can set options rankguard manages"),
    ],
)
def test_an_unknown_flag_or_a_config_file_is_refused_before_deploying_and_said_once(
    extra: list[str], said: str
) -> None:
    c = Cluster()
    c.spec["engine"]["extraArgs"] = extra
    steps = [c.run() for _ in range(3)]
    assert c.deployment is None and c.service is None
    assert c.status["phase"] == "Failed"
    d = degraded(c)
    assert d["reason"] == "InvalidSpec" and said in d["message"]
    assert "spec.engine.extraArgs[0]" in d["message"]
    assert len(events(steps, "InvalidSpec")) == 1  # once, not once per pass
    assert writes(steps[-1]) == []


def test_a_fixed_spec_no_longer_says_it_is_invalid_while_it_deploys() -> None:
    c = Cluster()
    c.spec["engine"]["extraArgs"] = ["--enable-frobnication"]
    c.run()
    assert degraded(c)["reason"] == "InvalidSpec"
    c.spec["engine"]["extraArgs"] = ["--enable-prefix-caching"]
    c.generation += 1
    c.run()  # deployed, not ready yet
    assert c.deployment is not None and c.status["phase"] == "Deploying"
    assert (degraded(c)["status"], degraded(c)["reason"]) == ("False", "AsExpected")


# --------------------------------------------------------------------------------------------
# 2. A pinned budget no engine can start with


def test_a_pinned_budget_of_one_byte_is_refused_by_the_parser() -> None:
    doc = copy.deepcopy(SPEC)
    doc["memory"] = {"kvCacheMemoryBytes": 1}
    with pytest.raises(SpecError, match=r"kvCacheMemoryBytes must be at least 1048576 \(1 MiB\), got 1"):
        parse_spec(doc)


def test_a_pinned_budget_below_one_request_is_refused_before_deploying() -> None:
    plan = prior_plan(parse_spec(SPEC))
    assert plan is not None
    c = Cluster()
    c.spec["memory"] = {"kvCacheMemoryBytes": 64 * MiB}  # above the CRD's minimum, below one request
    c.run()
    assert c.deployment is None and c.status["phase"] == "Failed"
    message = degraded(c)["message"]
    assert "spec.memory.kvCacheMemoryBytes" in message and "cannot hold one request" in message
    assert str(plan.min_kv_cache_memory_bytes) in message and "spec.engine.maxModelLen" in message
    # at exactly one request it is accepted (vLLM starts there: tests/e2e test_a_budget_at_the_floor_starts)
    ok = Cluster()
    ok.spec["memory"] = {"kvCacheMemoryBytes": plan.min_kv_cache_memory_bytes}
    ok.run()
    assert ok.deployment is not None


def test_an_engine_that_still_finds_the_pinned_budget_too_small_is_degraded_once() -> None:
    c = Cluster()
    plan = prior_plan(parse_spec(SPEC))
    assert plan is not None
    c.spec["memory"] = {"kvCacheMemoryBytes": plan.min_kv_cache_memory_bytes}
    c.run()
    c.controller_done()
    c.run()
    applies = len(c.deployments_applied)
    steps = []
    for run in range(4):
        crash_loop(c, kv_too_small_record(), run=run)
        steps.append(c.run())
        steps.append(c.run())
        d = degraded(c)
        assert (d["status"], d["reason"]) == ("True", "KVCacheTooSmall"), d
        assert c.status["phase"] == "Degraded"
        assert next(x for x in c.status["conditions"] if x["type"] == "Ready")["status"] == "False"
    assert "spec.memory.kvCacheMemoryBytes" in degraded(c)["message"]
    assert len(events(steps, "KVCacheTooSmall")) == 1
    assert len(c.deployments_applied) == applies  # a pinned budget is never changed


# --------------------------------------------------------------------------------------------
# 3. CUDA OOMs with the budget already at its floor


def at_the_floor() -> tuple[Cluster, int]:
    """A service whose planned budget is its floor (spec.remediation.minKVCacheBytes), running."""
    plan = prior_plan(parse_spec(SPEC))
    assert plan is not None
    c = Cluster()
    c.spec["remediation"] = {"minKVCacheBytes": plan.kv_cache_memory_bytes, "cooldownSeconds": 0}
    c.run()
    c.controller_done()
    c.run()
    assert c.status["phase"] == "Running"
    return c, plan.kv_cache_memory_bytes


def test_ooms_at_the_floor_are_degraded_and_stay_so_without_another_roll() -> None:
    c, floor = at_the_floor()
    applies = len(c.deployments_applied)
    steps = []
    for run in range(4):
        crash_loop(c, cuda_oom_record(), run=run)
        steps.append(c.run())
        d = degraded(c)
        assert (d["status"], d["reason"]) == ("True", "OOMAtFloor"), d
        # the pod restarts and serves again until the next peak: still Degraded, it will OOM again
        c.controller_done()
        steps.append(c.run())
        assert degraded(c)["reason"] == "OOMAtFloor" and c.status["phase"] == "Degraded"
    message = degraded(c)["message"]
    assert "already at its floor" in message and "rolls nothing more" in message
    for knob in ("spec.remediation.minKVCacheBytes", "spec.engine.maxModelLen", "spec.tensorParallelSize"):
        assert knob in message
    assert len(c.deployments_applied) == applies and flags_of(c.deployment).kv_cache_memory_bytes == floor
    assert not c.status.get("remediations")
    assert len(events(steps, "OOMAtFloor")) == 1
    # a person lowers the floor: the verdict goes, and rankguard may act again
    c.spec["remediation"] = {"minKVCacheBytes": floor // 2, "cooldownSeconds": 0}
    c.generation += 1
    c.run()
    assert degraded(c)["status"] == "False"


# --------------------------------------------------------------------------------------------
# 4. A replica the scheduler cannot place


def unschedulable(c: Cluster, message: str, *, terminating: bool = False) -> None:
    """The Deployment's pod waits for a node: PodScheduled False, as kube-scheduler writes it."""
    assert c.deployment is not None
    annotations = c.deployment["spec"]["template"]["metadata"]["annotations"]
    c.pods = [
        {
            "metadata": {"name": "svc-pending", "uid": "uid-pending", "annotations": dict(annotations)},
            "status": {
                "phase": "Pending",
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
                ],
            },
        }
    ]
    if terminating:
        c.pods.append(
            {
                "metadata": {
                    "name": "svc-old",
                    "uid": "uid-old",
                    "annotations": {},
                    "deletionTimestamp": "2027-01-15T08:00:00Z",
                },
                "status": {"phase": "Running"},
            }
        )


SCHEDULER = (
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: "
    "3 No preemption victims found for incoming pod."
)


def test_a_pod_that_cannot_be_scheduled_is_degraded_with_the_schedulers_words_once() -> None:
    c = Cluster()
    c.spec["tensorParallelSize"] = 64
    c.spec["model"] = {"name": "meta-llama/Meta-Llama-3-70B-Instruct"}
    c.run()
    unschedulable(c, SCHEDULER + " " + "node-x: taint; " * 200)
    steps = [c.run()]
    assert degraded(c)["status"] == "False"  # the scheduler may only be waiting: not yet
    assert parse_iso(c.status["unschedulableSince"]) == pytest.approx(c.clock - 2.0, abs=1.0)
    assert steps[0].pass_again_after == pytest.approx(UNSCHEDULABLE_AFTER_SECONDS)  # the edge comes back
    c.clock += UNSCHEDULABLE_AFTER_SECONDS
    steps += [c.run() for _ in range(4)]
    d = degraded(c)
    assert (d["status"], d["reason"]) == ("True", "Unschedulable"), d
    assert c.status["phase"] == "Degraded"
    assert SCHEDULER in d["message"] and "64 nvidia.com/gpu" in d["message"]
    assert "spec.tensorParallelSize" in d["message"] and len(d["message"]) < 1000
    assert len(events(steps, "Unschedulable")) == 1
    # nothing changes while it waits: nothing is written
    c.clock -= 2.0
    again = reconcile.step(c.state(), c.world(), SETTINGS)
    assert writes(again) == []
    # scheduled at last: the verdict goes at once
    c.controller_done()
    c.run()
    assert degraded(c)["status"] == "False" and "unschedulableSince" not in c.status


def test_a_pod_waiting_for_the_gpus_of_a_terminating_one_is_not_degraded() -> None:
    c = running()
    unschedulable(c, SCHEDULER, terminating=True)
    for _ in range(3):
        c.run()
        c.clock += UNSCHEDULABLE_AFTER_SECONDS
    assert degraded(c)["status"] == "False" and "unschedulableSince" not in c.status
    # the predecessor gone, the clock starts only now
    c.pods = c.pods[:1]
    c.run()
    assert degraded(c)["status"] == "False"
    assert parse_iso(c.status["unschedulableSince"]) == pytest.approx(c.clock - 2.0, abs=1.0)


# --------------------------------------------------------------------------------------------
# 5. A floor above the GPU's memory


def test_a_floor_above_the_gpu_in_the_spec_is_refused_by_the_parser() -> None:
    doc = copy.deepcopy(SPEC)
    doc["remediation"] = {"minKVCacheBytes": 960 * GiB}
    floor_above = r"minKVCacheBytes \(.*\) must be smaller than spec\.memory\.gpuMemoryBytes"
    with pytest.raises(SpecError, match=floor_above):
        parse_spec(doc)


GFD = {"nvidia.com/gpu.memory": str(80 * 1024), "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


@pytest.mark.parametrize(
    ("memory", "remediation", "said"),
    [
        ({}, {"minKVCacheBytes": 960 * GiB}, "spec.remediation.minKVCacheBytes (960Gi"),
        ({"kvCacheMemoryBytes": 96 * GiB}, {}, "spec.memory.kvCacheMemoryBytes (96Gi) is not below"),
    ],
)
def test_a_budget_above_the_gpu_the_nodes_label_is_refused_before_deploying(
    memory: dict[str, Any], remediation: dict[str, Any], said: str
) -> None:
    c = Cluster()
    c.spec["memory"] = memory
    c.spec["remediation"] = remediation
    steps = [c.run(node_labels={"gpu-node-1": GFD}) for _ in range(2)]
    assert c.deployment is None and c.service is None
    assert c.status["phase"] == "Failed"
    message = degraded(c)["message"]
    assert said in message and "80Gi, from the GPU Feature Discovery labels of node gpu-node-1" in message
    assert len(events(steps, "InvalidSpec")) == 1


def test_a_floor_above_the_gpu_the_agents_measured_is_refused() -> None:
    c = Cluster()
    del c.spec["memory"]
    c.status = {"gpuMemoryBytes": 80 * GiB}  # learned from the agents before (status keeps it)
    c.spec["remediation"] = {"minKVCacheBytes": 960 * GiB}
    c.run()
    assert c.deployment is None and c.status["phase"] == "Failed"
    assert "from the agents' measurement" in degraded(c)["message"]


def test_one_request_larger_than_the_gpu_is_refused() -> None:
    c = Cluster()
    c.spec["engine"] = {"maxModelLen": 10_000_000}  # 64 KiB per token per GPU: 610 GiB
    c.run()
    assert c.deployment is None and c.status["phase"] == "Failed"
    message = degraded(c)["message"]
    assert "one request of spec.engine.maxModelLen (10000000 tokens)" in message
    assert "spec.engine.maxModelLen" in message and "spec.tensorParallelSize" in message
