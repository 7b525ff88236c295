"""What the child's exit means: a PURE mapping to the termination message.

A memory cause seen in the output wins over how the process ended (vLLM often dies by a
signal from its own shutdown after a worker's OOM); a clean exit is a clean exit.

On one node the OOM's rank is the device PyTorch named. On a pod of a multi-node group it is the
global rank the launcher read from the failing worker's own line (`cause_rank`, see
`workers.WorkerRanks.rank_of_oom`), and every message says where the pod sits.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable

from rankguard_agent.wire.group import GroupPlace, local_gpu_rank
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


rank_of_gpu = local_gpu_rank  # PyTorch's "GPU i" is rank i of a single-node pod


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
    place: GroupPlace | None = None,
    cause_rank: int | None = None,
    phase: str | None = None,
    at_load: Callable[[int], tuple[int | None, int | None, int | None]] | None = None,
) -> TerminationMessage:
    """The message for an engine that ended with `returncode`. `place`: the pod's place in a
    multi-node group (None or one node: `rank` is the device PyTorch named, as always);
    `cause_rank`: in a group, the global rank the cause's own line named (None: unknown);
    `phase`: the engine's phase the OOM's rank was in (wire/phases.py), carried with a CUDA OOM,
    and with a SIGKILL (the host's OOM killer: the kubelet then says OOMKilled; the phase says
    whether it struck while the weights were staged or while serving); `at_load`: a local rank's
    free memory and others' memory when its worker began loading weights, and others' peak (the
    sampler's), carried with a CUDA OOM for its rank."""
    if isinstance(cause, CudaOom) and place is not None and place.multi_node:
        oom_rank = cause_rank
    else:
        oom_rank = local_gpu_rank(cause.gpu_index if isinstance(cause, CudaOom) else None, n_ranks)
    message = _message(returncode, cause, last_kv, oom_rank, launch_error=launch_error, last_error=last_error)
    if phase is not None and (
        message.reason == CUDA_OOM or (message.reason == SIGNALED and message.signal == signal.SIGKILL)
    ):
        message = dataclasses.replace(message, phase=phase)
    if at_load is not None and message.reason == CUDA_OOM and message.rank is not None:
        local = place.local_rank(message.rank) if place is not None and place.multi_node else message.rank
        if local is not None:
            free, others, peak = at_load(local)
            message = dataclasses.replace(
                message, free_at_load_bytes=free, others_at_load_bytes=others, others_peak_bytes=peak
            )
    return message if place is None else with_place(message, place)


def with_place(message: TerminationMessage, place: GroupPlace) -> TerminationMessage:
    """`message` saying where the pod sits in its multi-node group, and where its `rank` (global)
    sits; unchanged on one node."""
    if not place.multi_node:
        return message
    rank = message.rank
    return dataclasses.replace(
        message,
        node_rank=place.node_rank,
        nnodes=place.nnodes,
        local_rank=None if rank is None else place.local_rank(rank),
        stage=None if rank is None else place.stage(rank),
        tp_rank=None if rank is None else place.tp_rank(rank),
    )


def _message(
    returncode: int,
    cause: CudaOom | KVTooSmall | None,
    last_kv: KVObservation | None,
    oom_rank: int | None,
    *,
    launch_error: str | None,
    last_error: str | None,
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
            rank=oom_rank,
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
