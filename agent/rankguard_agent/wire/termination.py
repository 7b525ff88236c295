"""The termination message: what the launcher leaves in `/dev/termination-log` when vLLM exits.

The kubelet copies it into `status.containerStatuses[].lastState.terminated.message`, which
is how the operator learns that rank r ran out of GPU memory, and by how much. The kubelet
keeps at most 4096 bytes, so `to_json()` guarantees that bound.

`rank` is vLLM's GLOBAL rank. A pod of a vLLM multi-node group also says its place (`nnodes`,
`node_rank`) on every message, and with a known `rank` that rank's `local_rank` (the pod's GPU
index), pipeline `stage` and `tp_rank`; all of these are null on one node, where `rank` is the
pod's GPU index as before.

Standard library only: it runs inside the vLLM container and inside the operator.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

TERMINATION_VERSION = 1
MAX_TERMINATION_BYTES = 4096  # the kubelet's limit for a termination message

# Reasons the launcher writes. The operator acts on CUDAOutOfMemory and KVCacheTooSmall only.
CUDA_OOM = "CUDAOutOfMemory"
KV_CACHE_TOO_SMALL = "KVCacheTooSmall"  # vLLM refused to start: budget below one max-len request
ENGINE_ERROR = "EngineError"  # non-zero exit with no memory cause recognised
SIGNALED = "Signaled"  # killed by a signal (SIGTERM on a normal rollout, SIGKILL, ...)
COMPLETED = "Completed"
# the image's own vLLM refused the arguments before the engine started (agent/engine_judge.py);
# detail is vLLM's own message
ENGINE_REFUSED = "EngineRefusedArguments"
REASONS = (CUDA_OOM, KV_CACHE_TOO_SMALL, ENGINE_ERROR, SIGNALED, COMPLETED, ENGINE_REFUSED)

# The phase of vLLM 0.33's engine a rank was in when it ran out of memory, in the order the engine
# runs them (engine core: load the weights, profile run, KV allocation, CUDA-graph capture, sampler
# warm-up, then serving). Each is answered by its own lever (docs/remediation.md); None: unknown.
PHASE_WEIGHTS = "weights"  # loading the model's weights
PHASE_PROFILE = "profile"  # the profile run: a dummy forward at max_num_batched_tokens
PHASE_KV_ALLOCATION = "kv-allocation"  # the KV cache's tensors allocated
PHASE_CUDA_GRAPHS = "cuda-graph-capture"  # CUDA graphs captured, one per batch size
PHASE_SAMPLER_WARMUP = "sampler-warmup"  # the sampler's dummy run at max_num_seqs
PHASE_SERVING = "serving"  # after start-up: real requests
PHASES = (
    PHASE_WEIGHTS,
    PHASE_PROFILE,
    PHASE_KV_ALLOCATION,
    PHASE_CUDA_GRAPHS,
    PHASE_SAMPLER_WARMUP,
    PHASE_SERVING,
)


class TerminationError(ValueError):
    """The text is not a rankguard termination message (it may be a plain log tail)."""


@dataclass(frozen=True)
class TerminationMessage:
    reason: str
    exit_code: int
    rank: int | None = None  # the global rank that ran out (one node: index in the pod's visible GPUs)
    gpu_index: int | None = None  # the device index PyTorch printed
    requested_bytes: int | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    signal: int | None = None
    last_kv_line: str | None = None
    detail: str | None = None  # the recognised line, shortened
    # vLLM's start-up check refused (free memory at start < utilisation × total): the KV
    # budget is not what failed, the utilisation the check compares with is
    startup_check: bool = False
    # with startup_check: the weights another process holds on the device exceeded total x
    # utilisation ("Externally held weights on device ..."); the utilisation must rise above them
    external_weight_bytes: int | None = None
    # the engine phase the rank was in when it ran out of memory (PHASES); None: unknown
    phase: str | None = None
    # a CUDA OOM's rank: the GPU's free memory, and other processes' memory, when its worker began
    # loading weights in this run (vLLM 0.34 sizes against its init snapshot, taken just before);
    # None: not seen
    free_at_load_bytes: int | None = None
    others_at_load_bytes: int | None = None
    # ... and the most other processes held on its GPU since the agent started (their growth
    # since the load start may be what ran the engine out)
    others_peak_bytes: int | None = None
    # A pod of a vLLM multi-node group (None on one node): where the writer sits, and where `rank` sits
    node_rank: int | None = None  # the writing pod's --node-rank
    nnodes: int | None = None  # pods in the group
    local_rank: int | None = None  # `rank`'s GPU index on this pod
    stage: int | None = None  # `rank`'s pipeline stage (PP rank)
    tp_rank: int | None = None  # `rank`'s rank in its tensor-parallel group
    version: int = TERMINATION_VERSION

    def to_json(self) -> str:
        doc = asdict(self)
        text = json.dumps(doc, separators=(",", ":"))
        # Shorten free text until it fits the kubelet's limit; the numbers always survive.
        for key in ("detail", "last_kv_line"):
            if len(text.encode()) <= MAX_TERMINATION_BYTES:
                break
            doc[key] = None
            text = json.dumps(doc, separators=(",", ":"))
        return text


def _opt_int(doc: dict[str, Any], key: str) -> int | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TerminationError(f"{key}: expected a non-negative integer, got {v!r:.40}")
    return v


def _opt_bool(doc: dict[str, Any], key: str) -> bool:
    v = doc.get(key, False)
    if not isinstance(v, bool):
        raise TerminationError(f"{key}: expected true or false")
    return v


def _opt_str(doc: dict[str, Any], key: str) -> str | None:
    v = doc.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise TerminationError(f"{key}: expected a string")
    return v[:1024]


def parse_termination_message(text: str | None) -> TerminationMessage:
    """Parse a container's termination message. Raises TerminationError if it is not ours."""
    if not text:
        raise TerminationError("empty termination message")
    if len(text.encode("utf-8", "replace")) > MAX_TERMINATION_BYTES:
        raise TerminationError("termination message over 4096 bytes")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise TerminationError(f"not JSON (a log tail?): {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != TERMINATION_VERSION:
        raise TerminationError("not a rankguard termination message of a known version")
    reason = doc.get("reason")
    if reason not in REASONS:
        raise TerminationError(f"unknown reason {reason!r:.40}")
    exit_code = doc.get("exit_code")
    if isinstance(exit_code, bool) or not isinstance(exit_code, int):
        raise TerminationError("exit_code: expected an integer")
    node_rank, nnodes = _opt_int(doc, "node_rank"), _opt_int(doc, "nnodes")
    if (node_rank is None) != (nnodes is None):
        raise TerminationError("node_rank and nnodes come together")
    if nnodes is not None and node_rank is not None and not node_rank < nnodes:
        raise TerminationError(f"node_rank {node_rank} is not one of the group's 0..{nnodes - 1}")
    rank, local_rank = _opt_int(doc, "rank"), _opt_int(doc, "local_rank")
    # a phase this reader does not know (a newer agent's) reads as unknown, not as an error
    phase = _opt_str(doc, "phase")
    if local_rank is not None and (rank is None or rank < local_rank):
        raise TerminationError("local_rank: needs a rank at least as large")
    return TerminationMessage(
        reason=reason,
        exit_code=exit_code,
        rank=rank,
        gpu_index=_opt_int(doc, "gpu_index"),
        requested_bytes=_opt_int(doc, "requested_bytes"),
        free_bytes=_opt_int(doc, "free_bytes"),
        total_bytes=_opt_int(doc, "total_bytes"),
        signal=_opt_int(doc, "signal"),
        last_kv_line=_opt_str(doc, "last_kv_line"),
        detail=_opt_str(doc, "detail"),
        startup_check=_opt_bool(doc, "startup_check"),
        external_weight_bytes=_opt_int(doc, "external_weight_bytes"),
        phase=phase if phase in PHASES else None,
        free_at_load_bytes=_opt_int(doc, "free_at_load_bytes"),
        others_at_load_bytes=_opt_int(doc, "others_at_load_bytes"),
        others_peak_bytes=_opt_int(doc, "others_peak_bytes"),
        node_rank=node_rank,
        nnodes=nnodes,
        local_rank=local_rank,
        stage=_opt_int(doc, "stage"),
        tp_rank=_opt_int(doc, "tp_rank"),
    )
