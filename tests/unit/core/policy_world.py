"""The setting every policy test decides in, and the helpers that build its inputs.

Llama-3-70B, TP 4, 80 GiB GPUs, max_model_len 8192, container memory limit 64Gi. Its prior
plan gives a 38 GiB per-GPU budget in KV blocks of 1.25 MiB (UNIT); one request at
max_model_len needs 640 MiB, plus the block vLLM 0.33 holds back (the floor). The rules, the
guard rails and the bounds are tested against the same numbers, so they live here once.
"""

from __future__ import annotations

import copy
from typing import Any

from rankguard_operator.core.budget.bounds import block_unit, initial_plan, kv_floor
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.headroom import Observation, RankHeadroom
from rankguard_operator.core.observe.pods import RolloutState, Termination
from rankguard_operator.core.policy import PolicyInput
from rankguard_operator.core.policy.history import Remediation
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec
from rankguard_operator.core.units import GiB, MiB

DOC: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-70B"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 4,
    "engine": {"maxModelLen": 8192},
    # minHeadroomBytes above the CRD's default (128 MiB) so these figures keep clear of it
    "memory": {"gpuMemoryBytes": 80 * GiB, "minHeadroomBytes": 256 * MiB},
    "resources": {"limits": {"memory": "64Gi"}},
}


def spec_with(**sections: dict[str, Any]) -> ServiceSpec:
    doc = copy.deepcopy(DOC)
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    return parse_spec(doc)


SPEC = parse_spec(DOC)


def must(plan: Plan | None) -> Plan:
    assert plan is not None
    return plan


PLAN = must(initial_plan(SPEC))
UNIT = block_unit(PLAN)
KV = PLAN.kv_cache_memory_bytes
FLOOR = kv_floor(SPEC, PLAN)
MARGIN = 512 * MiB
MINH = 256 * MiB
CUR = ServingFlags(kv_cache_memory_bytes=KV)
LKG = ServingFlags(kv_cache_memory_bytes=KV - 2 * GiB)
NOW = 1_800_000_000.0
COMPLETE = RolloutState("complete", 1, 1, 1, 1, True, True, "Complete")
PROGRESSING = RolloutState("progressing", 1, 0, 0, 0, True, True, "Progressing", "0 of 1 replicas updated")
FAILED = RolloutState("failed", 1, 0, 0, 0, True, True, "ProgressDeadlineExceeded", "timed out progressing")


def obs(*min_free: int, stale: bool = False, kv_cache_bytes: int | None = None) -> Observation:
    return Observation(
        now=NOW,
        ranks=tuple(
            RankHeadroom(
                rank=i,
                uuid=f"GPU-{i}",
                pod="llama-0",
                total_bytes=80 * GiB,
                free_bytes=m,
                min_free_bytes=m,
                stale=stale,
            )
            for i, m in enumerate(min_free)
        ),
        fresh_pods=() if stale else ("llama-0",),
        stale_pods=("llama-0",) if stale else (),
        kv_cache_bytes=kv_cache_bytes,
    )


HEALTHY = obs(2 * GiB, 3 * GiB, 3 * GiB, 3 * GiB)
_counter = iter(range(10_000))


def term(
    kind: str = "CUDAOutOfMemory",
    *,
    rank: int | None = 2,
    requested: int | None = 2 * GiB,
    free: int | None = 512 * MiB,
    flags: ServingFlags | None = CUR,
    finished_at: float = NOW - 10,
    kv_cache_bytes: int | None = None,
    exit_code: int = 1,
) -> Termination:
    n = next(_counter)
    return Termination(
        pod_name="llama-0",
        pod_uid=f"uid-{n}",
        container="vllm",
        restart_count=0,
        kind=kind,  # type: ignore[arg-type]
        exit_code=exit_code,
        rank=rank,
        requested_bytes=requested,
        free_bytes=free,
        total_bytes=80 * GiB,
        finished_at=finished_at,
        message="CUDA out of memory" if kind == "CUDAOutOfMemory" else kind,
        kv_cache_bytes=kv_cache_bytes,
        flags=flags,
    )


def past(
    age: float,
    *,
    trigger: str = "CUDAOutOfMemory",
    action: str = "shrink",
    frm: int | None = KV + 2 * GiB,
    to: int = KV,
) -> Remediation:
    return Remediation(
        time=NOW - age,
        trigger=trigger,
        action=action,
        rank=0,
        from_flags=None if frm is None else ServingFlags(kv_cache_memory_bytes=frm),
        to_flags=ServingFlags(kv_cache_memory_bytes=to),
    )


def inp(**kw: Any) -> PolicyInput:
    args: dict[str, Any] = {"spec": SPEC, "now": NOW, "current": CUR, "plan": PLAN, "observation": HEALTHY}
    args.update(kw)
    return PolicyInput(**args)


# a bottleneck below the minimum headroom (rule 7, the trackers)
LOW = obs(3 * GiB, 100 * MiB, 3 * GiB, 3 * GiB)
# every rank well above 2 × the minimum headroom (rule 9, the trackers)
AMPLE = obs(6 * GiB, 5 * GiB, 6 * GiB, 6 * GiB)
