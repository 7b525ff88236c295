"""The utilisation rendered next to a byte budget, for vLLM's start-up check."""

from __future__ import annotations

import math
from typing import Any

from rankguard_operator.core.budget.bounds import (
    NO_PLAN_STARTUP_UTILIZATION,
    VLLM_DEFAULT_UTILIZATION,
    initial_plan,
    prior_plan,
    startup_utilization,
)
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.render.pod import vllm_args
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB


def small_cards(**memory: Any) -> Any:
    # Llama-3-8B, TP2 x PP2 on 24 GiB cards: NCCL alone is a fifth of each card.
    return parse_spec(
        {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "tensorParallelSize": 2,
            "pipelineParallelSize": 2,
            "engine": {"maxModelLen": 8192, "maxNumSeqs": 64},
            "memory": {"gpuMemoryBytes": 24 * GiB, **memory},
        }
    )


def test_the_startup_check_asks_only_for_what_vllm_will_use_and_fits_every_rank() -> None:
    spec = small_cards()
    plan = initial_plan(spec)
    assert plan is not None
    kv = plan.kv_cache_memory_bytes
    u = startup_utilization(prior_plan(spec), kv)
    assert u is not None and u < VLLM_DEFAULT_UTILIZATION  # the default would refuse to start here
    for r in plan.ranks:
        # What vLLM checks at start-up: free after context + NCCL >= u x total. With the
        # planner's context figure, every rank passes, with room to spare.
        free_at_start = r.total_bytes - r.context_bytes
        assert u * r.total_bytes <= free_at_start
        # and it still covers what the rank really uses besides context and NCCL
        assert u * r.total_bytes >= r.runtime_non_kv_bytes + kv
    # default 0.92 on 24 GiB asks for 22.08 GiB, more than a pipeline-terminal rank has free
    worst_free = min(r.total_bytes - r.context_bytes for r in plan.ranks)
    assert VLLM_DEFAULT_UTILIZATION * 24 * GiB > worst_free


def test_it_is_rendered_next_to_the_byte_budget_and_only_there() -> None:
    spec = small_cards()
    args = vllm_args(spec, ServingFlags(kv_cache_memory_bytes=8 * GiB), prior_plan(spec))
    i = args.index("--kv-cache-memory-bytes")
    assert args[i + 1] == str(8 * GiB)
    assert float(args[args.index("--gpu-memory-utilization") + 1]) == startup_utilization(
        prior_plan(spec), 8 * GiB
    )
    only_util = vllm_args(spec, ServingFlags(gpu_memory_utilization=0.8), prior_plan(spec))
    assert "--kv-cache-memory-bytes" not in only_util and only_util.count("--gpu-memory-utilization") == 1


def test_unknown_gpu_size_renders_half_the_card_not_vllms_default() -> None:
    """A pinned budget on a first start, no GPU size known: vLLM's 0.92 start-up check could
    refuse a small TP card after NCCL init; the byte budget sizes the KV cache either way."""
    spec = parse_spec(
        {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "tensorParallelSize": 2,
            "memory": {"kvCacheMemoryBytes": 8 * GiB},
        }
    )
    assert prior_plan(spec) is None
    assert startup_utilization(None, 8 * GiB) == NO_PLAN_STARTUP_UTILIZATION < VLLM_DEFAULT_UTILIZATION
    # weights held outside the process need total x util above them: without a total, vLLM's own
    assert startup_utilization(None, 8 * GiB, external_weight_bytes=30 * GiB) == VLLM_DEFAULT_UTILIZATION
    args = vllm_args(spec, ServingFlags(kv_cache_memory_bytes=8 * GiB), None)
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.5"
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(8 * GiB)


def test_big_cards_never_ask_for_more_than_vllms_default() -> None:
    spec = parse_spec(
        {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "memory": {"gpuMemoryBytes": 80 * GiB},
        }
    )
    assert startup_utilization(prior_plan(spec), 70 * GiB) == VLLM_DEFAULT_UTILIZATION


def test_it_stays_under_the_free_memory_vllm_measured_at_start_up() -> None:
    """Other CUDA contexts on GPU 0 are not in the priors; vLLM's own start-up figure is: the
    utilisation stays under it (less the safety margin), whatever the priors say."""
    spec = small_cards()
    plan = prior_plan(spec)
    assert plan is not None
    kv = 8 * GiB
    free_measured = 13 * GiB  # far less than the priors expect (another tenant on the card)
    u = startup_utilization(plan, kv, free_measured)
    assert u is not None and u * 24 * GiB <= free_measured - spec.memory.safety_margin_bytes
    assert u < startup_utilization(plan, kv)  # type: ignore[operator]
    # a generous measurement changes nothing: the priors' figure stands
    assert startup_utilization(plan, kv, 24 * GiB) == startup_utilization(plan, kv)
    args = vllm_args(spec, ServingFlags(kv_cache_memory_bytes=kv), plan, free_measured)
    assert float(args[args.index("--gpu-memory-utilization") + 1]) == u


def test_it_stays_above_weights_held_outside_the_process() -> None:
    """A zero-copy weight cache holds the weights in another process: vLLM refuses when they
    reach total x utilisation ("Externally held weights on device ..."), and checks its free
    memory against total x utilisation less them. So the utilisation stays above them (plus the
    safety margin), even above vLLM's default, and the free-memory cap moves up by them."""
    spec = small_cards()
    plan = prior_plan(spec)
    assert plan is not None
    total, margin, kv = 24 * GiB, spec.memory.safety_margin_bytes, 4 * GiB
    weights = 22 * GiB
    # vLLM measured the free memory next to those weights: 24 - 22 - context; the cap alone would
    # put the utilisation under the weights, which is the refusal itself
    free_measured = total - weights - GiB
    capped = startup_utilization(plan, kv, free_measured)
    assert capped is not None and capped * total <= weights
    u = startup_utilization(plan, kv, free_measured, weights)
    assert u is not None and u > VLLM_DEFAULT_UTILIZATION
    assert u * total >= weights + margin  # vLLM's first check passes
    assert u * total - weights <= free_measured  # and its check of the free memory too
    assert u == math.ceil((weights + margin) / total * 1000) / 1000
    # small weights change nothing the priors and the measurement did not already say
    assert startup_utilization(plan, kv, None, GiB) == startup_utilization(plan, kv)
    # weights that leave nothing: never above the whole card
    assert startup_utilization(plan, kv, None, total) == 1.0
    args = vllm_args(spec, ServingFlags(kv_cache_memory_bytes=kv), plan, free_measured, weights)
    assert float(args[args.index("--gpu-memory-utilization") + 1]) == u
