"""`status.capacity`: the tokens of KV cache ONE replica holds and the requests of max_model_len
it serves at once, for autoscalers and routers (issue 52), in vLLM's own units and label.

Before any engine of the flags in effect reports, the figures are the plan's, in tokens as
vLLM counts them (core/budget/kv_layout: `tokens`, `max_concurrency`); once one reports, they
are the engine's own "KV cache size: N tokens" and "Maximum concurrency" lines (the lowest over
fresh pods, core/observe/headroom). The engine's figures outlive the pods that printed them
(a service scaled to 0 replicas still has a known capacity for the scaler that scales it up)
for as long as the flags and the spec's budget inputs are those they were printed under.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rankguard_operator.core.budget.bounds import VLLM_DEFAULT_UTILIZATION, utilization_kv_bytes
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.headroom import Observation
from rankguard_operator.core.spec.parse import ServiceSpec

PLANNED = "planned"
ENGINE = "engine"


def model_name(spec: ServiceSpec) -> str:
    """What vLLM puts in its metrics' `model_name` label: the first --served-model-name, else
    the model (vLLM's config/model.py get_served_model_name)."""
    return spec.engine.served_model_name or spec.model.name


def planned_kv_bytes(plan: Plan, flags: ServingFlags) -> int:
    """The per-GPU KV bytes the flags give under `plan`: the byte budget, else the plan's
    estimate of what the rendered utilisation leaves (vLLM's default one when none is
    rendered; in engine-measured mode the engine measures after warm-up, and this is the plan's
    guess at what it will find)."""
    if flags.kv_cache_memory_bytes is not None:
        return flags.kv_cache_memory_bytes
    util = flags.gpu_memory_utilization
    return utilization_kv_bytes(plan, VLLM_DEFAULT_UTILIZATION if util is None else util)


def capacity_status(
    plan: Plan | None,
    flags: ServingFlags | None,
    spec: ServiceSpec,
    observation: Observation | None,
    *,
    old: Mapping[str, Any],
    budget_key: str | None,
) -> dict[str, Any] | None:
    """`status.capacity` as this pass knows it, or None (not known: no flags, no plan and no
    engine figure). `old`: the status as stored (its capacity, servingFlags and budgetKey say
    whether an engine's figure still holds); `budget_key`: this pass's (bounds.budget_key)."""
    if flags is None:
        return None
    name = model_name(spec)
    engine = _engine_figures(observation, plan)
    if engine is not None:
        tokens, concurrency = engine
        return _doc(tokens, concurrency, ENGINE, name)
    carried = _carried(old, flags, budget_key)
    if carried is not None:
        return {**carried, "modelName": name}
    if plan is None:
        return None
    cap = plan.capacity(planned_kv_bytes(plan, flags))
    return _doc(cap.tokens, cap.max_concurrency, PLANNED, name)


def _doc(tokens: int, concurrency: float | None, source: str, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"tokens": tokens, "source": source, "modelName": name[:253]}
    if concurrency is not None:
        doc["maxConcurrency"] = round(concurrency, 2)
    return doc


def _engine_figures(observation: Observation | None, plan: Plan | None) -> tuple[int, float | None] | None:
    """The engines' own figures: tokens, and their printed concurrency (an engine that printed
    only its size, as vLLM did before 0.33: tokens over max_model_len, vLLM's own definition,
    kv_cache_utils.py get_kv_cache_capacity)."""
    tokens = None if observation is None else observation.kv_cache_tokens
    if observation is None or tokens is None:
        return None
    concurrency = observation.kv_max_concurrency
    if concurrency is None and plan is not None:
        concurrency = tokens / plan.max_model_len
    return tokens, concurrency


def _carried(old: Mapping[str, Any], flags: ServingFlags, budget_key: str | None) -> dict[str, Any] | None:
    """The last engine figure, while the flags and the budget's spec inputs are unchanged (no
    pod reports at 0 replicas, or between reports); None once either changed: the new flags'
    engine has not spoken yet, and the plan speaks for it."""
    cap = old.get("capacity")
    if not isinstance(cap, Mapping) or cap.get("source") != ENGINE:
        return None
    if budget_key is None or old.get("budgetKey") != budget_key:
        return None
    if old.get("servingFlags") != flags.to_status():
        return None
    tokens = cap.get("tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool):
        return None
    return dict(cap)
