"""`spec.remediation`: the guard rails on automatic changes and how far each OOM lever may move.

One section of the spec (core/spec/parse.py reads the rest), kept apart because the levers'
floors (`spec.remediation.levers`, read by core/policy/oom_levers.py) grew it past one parser.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.spec.crd import (
    DEFAULT_COOLDOWN_SECONDS,
    DEFAULT_HOST_MEMORY_BUMP_RATIO,
    DEFAULT_MAX_PER_HOUR,
    DEFAULT_MIN_CUDAGRAPH_CAPTURE_SIZE,
    DEFAULT_MIN_NUM_BATCHED_TOKENS,
    DEFAULT_MIN_NUM_SEQS,
    MAX_CUDAGRAPH_CAPTURE_SIZE,
    MAX_GPU_BYTES,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
)
from rankguard_operator.core.spec.fields import (
    SpecError,
    bool_field,
    int_field,
    memory_quantity,
    number_field,
    required_int,
    section,
)


@dataclass(frozen=True)
class LeverFloors:
    """spec.remediation.levers: how far rankguard may move each OOM lever."""

    min_num_seqs: int = DEFAULT_MIN_NUM_SEQS
    min_num_batched_tokens: int = DEFAULT_MIN_NUM_BATCHED_TOKENS
    min_cudagraph_capture_size: int = DEFAULT_MIN_CUDAGRAPH_CAPTURE_SIZE
    allow_enforce_eager: bool = True


@dataclass(frozen=True)
class RemediationSpec:
    enabled: bool = True
    cooldown_seconds: int = DEFAULT_COOLDOWN_SECONDS
    max_per_hour: int = DEFAULT_MAX_PER_HOUR
    min_kv_cache_bytes: int | None = None
    max_kv_cache_bytes: int | None = None
    host_memory_bump_ratio: float = DEFAULT_HOST_MEMORY_BUMP_RATIO
    max_host_memory_bytes: int | None = None
    levers: LeverFloors = field(default_factory=LeverFloors)


def parse_remediation(
    spec: Mapping[str, Any], *, gpu_memory_bytes: int | None, pinned_kv_bytes: int | None
) -> RemediationSpec:
    """spec.remediation, checked against spec.memory's GPU size and pinned budget."""
    w = "spec.remediation"
    r = section(spec, "remediation", "spec")
    lo = int_field(r, "minKVCacheBytes", w, None, lo=1, hi=MAX_GPU_BYTES)
    hi = int_field(r, "maxKVCacheBytes", w, None, lo=1, hi=MAX_GPU_BYTES)
    if lo is not None and hi is not None and lo > hi:
        raise SpecError(
            f"spec.remediation.minKVCacheBytes ({lo}, the floor) must be <= "
            f"spec.remediation.maxKVCacheBytes ({hi}, the ceiling)"
        )
    gpu = gpu_memory_bytes
    if lo is not None and gpu is not None and lo >= gpu:
        raise SpecError(
            f"spec.remediation.minKVCacheBytes ({lo}, the floor of the per-GPU KV budget) must be smaller "
            f"than spec.memory.gpuMemoryBytes ({gpu}): no budget can satisfy a floor above one GPU's "
            "memory; lower the floor well below it (the weights and buffers share each GPU)"
        )
    pinned = pinned_kv_bytes
    if pinned is not None and lo is not None and pinned < lo:
        raise SpecError(
            "spec.memory.kvCacheMemoryBytes is below spec.remediation.minKVCacheBytes: raise the pinned "
            "budget or lower the floor"
        )
    if pinned is not None and hi is not None and pinned > hi:
        raise SpecError(
            "spec.memory.kvCacheMemoryBytes is above spec.remediation.maxKVCacheBytes: lower the pinned "
            "budget or raise the ceiling"
        )
    ratio = number_field(r, "hostMemoryBumpRatio", w, DEFAULT_HOST_MEMORY_BUMP_RATIO, lo=1.0, hi=4.0)
    assert ratio is not None
    return RemediationSpec(
        enabled=bool_field(r, "enabled", w, True),
        cooldown_seconds=required_int(r, "cooldownSeconds", w, DEFAULT_COOLDOWN_SECONDS, lo=0, hi=86400),
        max_per_hour=required_int(r, "maxPerHour", w, DEFAULT_MAX_PER_HOUR, lo=0, hi=60),
        min_kv_cache_bytes=lo,
        max_kv_cache_bytes=hi,
        host_memory_bump_ratio=ratio,
        max_host_memory_bytes=memory_quantity(r, "maxHostMemory", w),
        levers=_parse_levers(r),
    )


def _parse_levers(r: Mapping[str, Any]) -> LeverFloors:
    w = "spec.remediation.levers"
    lv = section(r, "levers", "spec.remediation")
    return LeverFloors(
        min_num_seqs=required_int(lv, "minNumSeqs", w, DEFAULT_MIN_NUM_SEQS, lo=1, hi=MAX_NUM_SEQS),
        min_num_batched_tokens=required_int(
            lv, "minNumBatchedTokens", w, DEFAULT_MIN_NUM_BATCHED_TOKENS, lo=1, hi=MAX_NUM_BATCHED_TOKENS
        ),
        min_cudagraph_capture_size=required_int(
            lv,
            "minCudaGraphCaptureSize",
            w,
            DEFAULT_MIN_CUDAGRAPH_CAPTURE_SIZE,
            lo=1,
            hi=MAX_CUDAGRAPH_CAPTURE_SIZE,
        ),
        allow_enforce_eager=bool_field(lv, "allowEnforceEager", w, True),
    )
