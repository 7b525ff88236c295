"""Status builders: the rank table, printer columns, budget, conditions, phase, history, patches."""

from __future__ import annotations

from typing import Any

import pytest

from rankguard_operator.core.budget.bounds import initial_plan as budget_plan
from rankguard_operator.core.budget.kv_model import capacity_for_budget
from rankguard_operator.core.budget.planner import Plan, RankMeasurement
from rankguard_operator.core.conditions import phase_for, set_condition
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.headroom import Observation, RankHeadroom
from rankguard_operator.core.observe.pods import RolloutState, Termination
from rankguard_operator.core.policy import Decision, PolicyInput, decide
from rankguard_operator.core.policy.history import Remediation, history_from_status
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.status.build import (
    append_history,
    budget_source,
    budget_status,
    build_status,
    last_known_good_status,
    rank_rows,
    summary_fields,
)
from rankguard_operator.core.status.patch import status_patch
from rankguard_operator.core.units import GiB, MiB

SPEC = parse_spec(
    {
        "model": {"name": "meta-llama/Meta-Llama-3-70B"},
        "image": "vllm/vllm-openai:v0.33.0",
        "tensorParallelSize": 4,
        "engine": {"maxModelLen": 8192},
        "memory": {"gpuMemoryBytes": 80 * GiB},
    }
)


def _must(plan: Plan | None) -> Plan:
    assert plan is not None
    return plan


PLAN = _must(budget_plan(SPEC))
KV = PLAN.kv_cache_memory_bytes
FLAGS = ServingFlags(kv_cache_memory_bytes=KV)
NOW = 1_800_000_000.0
T0 = "2027-01-15T08:00:00Z"
T1 = "2027-01-15T08:05:00Z"


def row(rank: int, min_free: int, *, stale: bool = False) -> RankHeadroom:
    return RankHeadroom(
        rank=rank,
        uuid=f"GPU-{rank}",
        pod="llama-0",
        total_bytes=80 * GiB,
        free_bytes=min_free + 10 * MiB,
        min_free_bytes=min_free,
        stale=stale,
    )


OBS = Observation(now=NOW, ranks=(row(0, 2 * GiB), row(1, 1946 * MiB), row(2, 3 * GiB), row(3, 3 * GiB)))


# --- ranks and columns -------------------------------------------------------------------------


def test_rank_rows() -> None:
    rows = rank_rows(Observation(now=NOW, ranks=(row(0, 2 * GiB), row(1, 1946 * MiB, stale=True))), tp=1)
    assert rows == [
        {
            "rank": 0,
            "uuid": "GPU-0",
            "pod": "llama-0",
            "stage": 0,
            "totalBytes": 80 * GiB,
            "freeBytes": 2 * GiB + 10 * MiB,
            "minFreeBytes": 2 * GiB,
            "headroomBytes": 2 * GiB,
            "headroom": "2Gi",
            "stale": False,
        },
        {
            "rank": 1,
            "uuid": "GPU-1",
            "pod": "llama-0",
            "stage": 1,  # tp 1: every rank is a stage of its own
            "totalBytes": 80 * GiB,
            "freeBytes": 1956 * MiB,
            "minFreeBytes": 1946 * MiB,
            "headroomBytes": 1946 * MiB,
            "headroom": "1.9Gi",
            "stale": True,
        },
    ]
    assert rank_rows(None) == []


def test_summary_fields() -> None:
    assert summary_fields(OBS, FLAGS, 1, 1) == {
        "ready": "1/1",
        "readyReplicas": 1,
        "kvBudget": "37Gi",
        "rank0Headroom": "2Gi",
        "minHeadroom": "1.9Gi",
        "bottleneck": "rank 1",
        "bottleneckRank": 1,
        "bottleneckPod": "llama-0",
        "bottleneckStage": None,  # no spec given: its split is not known
    }
    stale0 = Observation(now=NOW, ranks=(row(0, GiB, stale=True), row(1, 3 * GiB)))
    s = summary_fields(stale0, ServingFlags(gpu_memory_utilization=0.92), 0, 2)
    assert (s["ready"], s["kvBudget"], s["rank0Headroom"], s["bottleneck"]) == (
        "0/2",
        "util 0.92",
        "stale",
        "rank 1",
    )
    empty = summary_fields(None, None, 0, 1)
    assert empty["kvBudget"] is None and empty["minHeadroom"] is None and empty["bottleneckRank"] is None


# --- budget ---------------------------------------------------------------------------------------


def test_budget_status_from_the_plan() -> None:
    b = budget_status(PLAN, FLAGS, SPEC)
    assert b["source"] == "planned" and b["kvCacheMemoryBytes"] == KV
    assert (b["blocks"], b["tokens"], b["maxConcurrency"]) == (
        PLAN.kv_blocks,
        PLAN.kv_tokens,
        round(PLAN.max_concurrency, 2),
    )
    assert b["gpuMemoryUtilization"] == pytest.approx(PLAN.gpu_memory_utilization, abs=1e-4)
    smaller = budget_status(PLAN, ServingFlags(kv_cache_memory_bytes=KV // 2), SPEC)
    cap = capacity_for_budget(PLAN.inputs.shape, 4, KV // 2, max_model_len=8192)
    assert (smaller["blocks"], smaller["tokens"]) == (cap.blocks, cap.tokens)
    assert budget_status(None, None, SPEC) == {}
    util = budget_status(PLAN, ServingFlags(gpu_memory_utilization=0.9), SPEC)
    assert util["source"] == "utilization" and util["gpuMemoryUtilization"] == 0.9 and util["blocks"] > 0
    assert budget_status(None, FLAGS, SPEC) == {"source": "planned", "kvCacheMemoryBytes": KV}


def rem(action: str, to: int, trigger: str = "CUDAOutOfMemory") -> Remediation:
    return Remediation(NOW, trigger, action, 0, FLAGS, ServingFlags(kv_cache_memory_bytes=to))


@pytest.mark.parametrize(
    ("flags", "plan", "last", "spec_doc", "source"),
    [
        (FLAGS, PLAN, None, None, "planned"),
        (ServingFlags(kv_cache_memory_bytes=123 * MiB), None, rem("shrink", 123 * MiB), None, "remediated"),
        (ServingFlags(kv_cache_memory_bytes=7 * GiB), None, rem("rollback", 7 * GiB), None, "rolled-back"),
        (
            ServingFlags(kv_cache_memory_bytes=7 * GiB),
            None,
            rem("replan", 7 * GiB, "Measured"),
            None,
            "measured",
        ),
        (ServingFlags(gpu_memory_utilization=0.9), PLAN, None, None, "utilization"),
        (
            ServingFlags(kv_cache_memory_bytes=30 * GiB),
            PLAN,
            None,
            {"kvCacheMemoryBytes": 30 * GiB},
            "pinned",
        ),
    ],
)
def test_budget_source(
    flags: ServingFlags, plan: Any, last: Remediation | None, spec_doc: dict[str, Any] | None, source: str
) -> None:
    spec = SPEC
    if spec_doc is not None:
        spec = parse_spec(
            {"model": {"name": "meta-llama/Meta-Llama-3-70B"}, "image": "v", "memory": spec_doc}
        )
    assert budget_source(plan, flags, spec, last) == source


def test_budget_source_measured_plan() -> None:
    m = [RankMeasurement(r, total_bytes=80 * GiB, free_after_init_bytes=75 * GiB) for r in range(4)]
    measured = budget_plan(SPEC, measured=m)
    assert measured is not None
    assert budget_source(PLAN, FLAGS, SPEC) == "planned"
    flags = ServingFlags(kv_cache_memory_bytes=measured.kv_cache_memory_bytes)
    assert budget_source(measured, flags, SPEC) == "measured"


# --- conditions and phase ------------------------------------------------------------------------


def test_set_condition_moves_the_transition_time_only_on_a_status_change() -> None:
    c = set_condition([], "Ready", "False", "ReplicasNotReady", "0/1", T0, 1)
    assert c == [
        {
            "type": "Ready",
            "status": "False",
            "reason": "ReplicasNotReady",
            "message": "0/1",
            "lastTransitionTime": T0,
            "observedGeneration": 1,
        }
    ]
    same = set_condition(c, "Ready", "False", "Waiting", "still 0/1", T1, 2)
    assert same[0]["lastTransitionTime"] == T0
    assert (same[0]["reason"], same[0]["message"], same[0]["observedGeneration"]) == (
        "Waiting",
        "still 0/1",
        2,
    )
    flipped = set_condition(same, "Ready", "True", "ReplicasReady", "1/1", T1, 2)
    assert flipped[0]["lastTransitionTime"] == T1
    both = set_condition(flipped, "Degraded", "False", "AsExpected", "", T1, 2)
    assert [x["type"] for x in both] == ["Ready", "Degraded"] and c[0]["status"] == "False"  # input untouched


def cond(**status: str) -> list[dict[str, Any]]:
    return [{"type": t, "status": s} for t, s in status.items()]


@pytest.mark.parametrize(
    ("conditions", "failed", "phase"),
    [
        ([], False, "Pending"),
        (cond(Progressing="True"), False, "Deploying"),
        (cond(Ready="True", Progressing="False"), False, "Running"),
        (cond(Ready="True", Remediating="True"), False, "Remediating"),
        (cond(Ready="True", Remediating="True", Degraded="True"), False, "Degraded"),
        (cond(Ready="True"), True, "Failed"),
    ],
)
def test_phase_for(conditions: list[dict[str, Any]], failed: bool, phase: str) -> None:
    assert phase_for(conditions, failed=failed) == phase


# --- history --------------------------------------------------------------------------------------


def test_append_history_keeps_the_newest_twenty() -> None:
    h: list[dict[str, Any]] = []
    for i in range(25):
        h = append_history(h, {"n": i})
    assert len(h) == 20 and h[0] == {"n": 5} and h[-1] == {"n": 24}
    r = Remediation(NOW, "OOMKilled", "raise-memory-limit", None, FLAGS, FLAGS.with_memory_limit(64 * GiB))
    assert append_history(h, r, limit=3)[-1]["action"] == "BumpMemoryLimit"


def test_remediation_round_trip_with_and_without_the_flag_objects() -> None:
    r = Remediation(
        time=NOW,
        trigger="CUDAOutOfMemory",
        action="shrink",
        rank=2,
        from_flags=ServingFlags(kv_cache_memory_bytes=KV, memory_limit_bytes=64 * GiB),
        to_flags=ServingFlags(kv_cache_memory_bytes=KV - GiB, memory_limit_bytes=64 * GiB),
        revision="abc123",
        message="rank 2 ran out",
    )
    doc = r.to_status()
    assert doc == {
        "time": "2027-01-15T08:00:00Z",
        "trigger": "CUDAOutOfMemory",
        "action": "ShrinkKVCache",
        "message": "rank 2 ran out",
        "rank": 2,
        "from": KV,
        "to": KV - GiB,
        "revision": "abc123",
        "fromFlags": {"kvCacheMemoryBytes": KV, "memoryLimit": "64Gi"},
        "toFlags": {"kvCacheMemoryBytes": KV - GiB, "memoryLimit": "64Gi"},
    }
    assert Remediation.from_status(doc) == r
    # a schema that prunes the flag objects still keeps what the policy needs
    pruned = {k: v for k, v in doc.items() if not k.endswith("Flags")}
    back = Remediation.from_status(pruned)
    assert back is not None and back.action == "shrink" and back.time == NOW
    assert back.to_flags == ServingFlags(kv_cache_memory_bytes=KV - GiB)
    bump = Remediation(NOW, "OOMKilled", "raise-memory-limit", None, FLAGS, FLAGS.with_memory_limit(80 * GiB))
    bdoc = {k: v for k, v in bump.to_status().items() if not k.endswith("Flags")}
    assert "from" not in bdoc and bdoc["to"] == "80Gi"  # the spec's limit was in effect before
    assert Remediation.from_status(bdoc).to_flags.memory_limit_bytes == 80 * GiB  # type: ignore[union-attr]
    util = Remediation(NOW, "CUDAOutOfMemory", "shrink", 0, ServingFlags(gpu_memory_utilization=0.9), FLAGS)
    assert util.to_status()["from"] == "util=0.9"
    assert history_from_status([{"time": "bad"}, doc, "x"]) == [r]
    assert history_from_status(None) == []


def test_last_known_good_status_reads_back() -> None:
    lkg = ServingFlags(kv_cache_memory_bytes=KV, memory_limit_bytes=64 * GiB)
    doc = last_known_good_status(lkg, SPEC, PLAN)
    assert doc is not None and doc["kvCacheMemoryBytes"] == KV and doc["memoryLimit"] == "64Gi"
    assert "--kv-cache-memory-bytes" in doc["flags"] and str(KV) in doc["flags"]
    assert ServingFlags.from_status(doc) == lkg
    assert last_known_good_status(None, SPEC, PLAN) is None


# --- status_patch ---------------------------------------------------------------------------------


def test_status_patch() -> None:
    old = {
        "phase": "Running",
        "budget": {"source": "planned", "blocks": 5},
        "kopf": {"x": 1},
        "ranks": [1, 2],
    }
    assert status_patch(old, {"phase": "Running", "budget": {"source": "planned", "blocks": 5}}) is None
    p = status_patch(old, {"phase": "Degraded", "budget": {"source": "planned"}, "ranks": [1]})
    assert p == {"phase": "Degraded", "budget": {"blocks": None}, "ranks": [1]}  # kopf's field left alone
    assert status_patch(old, {"minHeadroom": None}) is None  # removing what is not there
    assert status_patch(old, {"phase": None}) == {"phase": None}
    assert status_patch(None, {"phase": "Pending"}) == {"phase": "Pending"}


# --- the whole status -----------------------------------------------------------------------------

COMPLETE = RolloutState("complete", 1, 1, 1, 1, True, True, "Complete")
ROLLING = RolloutState(
    "progressing", 1, 1, 0, 0, True, True, "Progressing", "0 of 1 updated replicas available"
)


def status_after(
    decision: Decision | None,
    rollout: RolloutState,
    ready: int,
    old: dict[str, Any],
    now: str,
    *,
    flags: ServingFlags = FLAGS,
) -> Any:
    flags = decision.flags if decision is not None else flags
    history = list(old.get("remediations") or [])
    if decision is not None and decision.is_remediation:
        history = append_history(history, decision.remediation(NOW, revision="r1"))
    return build_status(
        old=old,
        spec=SPEC,
        generation=3,
        now_iso=now,
        observation=OBS,
        flags=flags,
        last_known_good=FLAGS,
        plan=PLAN,
        prior=PLAN,
        decision=decision,
        rollout=rollout,
        ready_replicas=ready,
        history=history,
    )


def test_remediating_then_running() -> None:
    oom = Termination("llama-0", "u1", "vllm", 0, "CUDAOutOfMemory", 1, 0, 2 * GiB, 512 * MiB, flags=FLAGS)
    d = decide(
        PolicyInput(spec=SPEC, now=NOW, current=FLAGS, plan=PLAN, observation=OBS, new_terminations=[oom])
    )
    assert d.action == "shrink"
    s1 = status_after(d, ROLLING, 0, {}, T0)
    conds = {c["type"]: c for c in s1["conditions"]}
    assert conds["Remediating"]["status"] == "True" and conds["Remediating"]["reason"] == "ShrinkKVCache"
    assert conds["Ready"]["status"] == "False" and conds["Degraded"]["status"] == "False"
    assert s1["phase"] == "Remediating" and s1["observedGeneration"] == 3
    assert s1["remediations"][-1]["action"] == "ShrinkKVCache" and s1["remediations"][-1]["revision"] == "r1"
    assert s1["kvBudget"] == "35Gi" and s1["budget"]["source"] == "remediated"
    assert s1["lastKnownGood"]["kvCacheMemoryBytes"] == KV and s1["bottleneck"] == "rank 1"
    # next pass: still rolling, no new decision -> still Remediating
    s2 = status_after(None, ROLLING, 0, s1, T1, flags=d.flags)
    assert s2["phase"] == "Remediating"
    c2 = {c["type"]: c for c in s2["conditions"]}["Remediating"]
    assert (c2["status"], c2["reason"], c2["lastTransitionTime"]) == ("True", "RollingOut", T0)
    # rolled out and ready -> Running, Remediating False
    s3 = status_after(None, COMPLETE, 1, s2, T1, flags=d.flags)
    c3 = {c["type"]: c for c in s3["conditions"]}
    assert (c3["Ready"]["status"], c3["Remediating"]["status"], s3["phase"]) == ("True", "False", "Running")
    assert c3["Ready"]["lastTransitionTime"] == T1
    assert (
        status_patch(s3, status_after(None, COMPLETE, 1, s3, T1, flags=d.flags)) is None
    )  # unchanged: no write


def test_degraded_sticks_until_ready() -> None:
    degrade = Decision(
        "degrade", FLAGS, "KVCacheTooSmall", "KVCacheTooSmall", "lower maxModelLen", from_flags=FLAGS
    )
    s1 = status_after(degrade, ROLLING, 0, {}, T0)
    assert s1["phase"] == "Degraded"
    s2 = status_after(None, ROLLING, 0, s1, T1)  # between two crashes
    c2 = {c["type"]: c for c in s2["conditions"]}
    assert (c2["Degraded"]["status"], c2["Degraded"]["reason"], s2["phase"]) == (
        "True",
        "KVCacheTooSmall",
        "Degraded",
    )
    s3 = status_after(None, COMPLETE, 1, s2, T1)
    assert {c["type"]: c for c in s3["conditions"]}["Degraded"]["status"] == "False" and s3[
        "phase"
    ] == "Running"


def test_a_rollback_keeps_the_service_degraded_with_the_reason_until_the_next_change() -> None:
    newer = ServingFlags(kv_cache_memory_bytes=KV - 2 * GiB)
    rollback = Decision(
        "rollback", FLAGS, "EngineError", "Rollback", "vLLM exited with an engine error", from_flags=newer
    )
    s1 = status_after(rollback, ROLLING, 0, {}, T0)
    # Ready again on the last known good flags, and still Degraded: it is not what was asked.
    s2 = status_after(None, COMPLETE, 1, s1, T1, flags=FLAGS)
    c2 = {c["type"]: c for c in s2["conditions"]}
    assert c2["Ready"]["status"] == "True"
    assert (c2["Degraded"]["status"], c2["Degraded"]["reason"]) == ("True", "RolledBack")
    assert "engine error" in c2["Degraded"]["message"] and "last known good" in c2["Degraded"]["message"]
    # The next change (here a shrink after an OOM) clears it once it is ready.
    shrink = Decision("shrink", newer, "CUDAOutOfMemory", "ShrinkKVCache", "shrink", from_flags=FLAGS)
    s3 = status_after(shrink, ROLLING, 0, s2, T1)
    s4 = status_after(None, COMPLETE, 1, s3, T1, flags=newer)
    assert {c["type"]: c for c in s4["conditions"]}["Degraded"]["status"] == "False"
