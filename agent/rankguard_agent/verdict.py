"""What the child's exit means: a PURE mapping to the termination message.

A memory cause seen in the output wins over how the process ended (vLLM often dies by a
signal from its own shutdown after a worker's OOM); a clean exit is a clean exit.
"""

from __future__ import annotations

import signal

from rankguard_agent.wire.recognisers import CudaOom, KVObservation, KVTooSmall
from rankguard_agent.wire.termination import (
    COMPLETED,
    CUDA_OOM,
    ENGINE_ERROR,
    KV_CACHE_TOO_SMALL,
    SIGNALED,
    TerminationMessage,
)

DETAIL_CHARS = 1024


def exit_code_of(returncode: int) -> int:
    """asyncio/subprocess say -N for death by signal N; a shell says 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def rank_of_gpu(gpu_index: int | None, n_ranks: int) -> int | None:
    """PyTorch's "GPU i" is the engine's local device i, which is rank i of this pod."""
    if gpu_index is None or gpu_index < 0:
        return None
    if n_ranks > 0 and gpu_index >= n_ranks:
        return None  # the engine saw other devices than the agent did; do not guess
    return gpu_index


def _short(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 1] + "…"


def termination_message(
    returncode: int,
    cause: CudaOom | KVTooSmall | None,
    last_kv: KVObservation | None,
    n_ranks: int,
    *,
    launch_error: str | None = None,
    last_error: str | None = None,
) -> TerminationMessage:
    exit_code = exit_code_of(returncode)
    sig = -returncode if returncode < 0 else None
    last_kv_line = _short(last_kv.text) if last_kv is not None else None
    if launch_error is not None:
        return TerminationMessage(
            ENGINE_ERROR, exit_code, detail=_short(launch_error), last_kv_line=last_kv_line
        )
    if returncode == 0:
        return TerminationMessage(COMPLETED, 0, last_kv_line=last_kv_line)
    if isinstance(cause, CudaOom):
        return TerminationMessage(
            CUDA_OOM,
            exit_code,
            rank=rank_of_gpu(cause.gpu_index, n_ranks),
            gpu_index=cause.gpu_index,
            requested_bytes=cause.requested_bytes,
            free_bytes=cause.free_bytes,
            total_bytes=cause.total_bytes,
            signal=sig,
            last_kv_line=last_kv_line,
            detail=_short(cause.text),
            startup_check=cause.startup_check,
            external_weight_bytes=cause.external_weight_bytes,
        )
    if isinstance(cause, KVTooSmall):
        return TerminationMessage(
            KV_CACHE_TOO_SMALL,
            exit_code,
            requested_bytes=cause.needed_bytes,
            free_bytes=cause.available_bytes,
            signal=sig,
            last_kv_line=last_kv_line,
            detail=_short(cause.text),
        )
    if sig is not None:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return TerminationMessage(SIGNALED, exit_code, signal=sig, last_kv_line=last_kv_line, detail=name)
    detail = _short(last_error) if last_error else None
    return TerminationMessage(ENGINE_ERROR, exit_code, last_kv_line=last_kv_line, detail=detail)
