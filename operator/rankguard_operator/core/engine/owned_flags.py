"""The vLLM options rankguard owns, and the check of a spec's extraArgs against vLLM's own CLI.

rankguard renders these options itself (the budget, the split, the engine fields of the spec,
the listen address). They are named by vLLM's `dest` (the config field), and every spelling of
each comes from the vLLM snapshot (`--gpu-memory-utilization` and its alias
`--device-memory-utilization`, `--enforce-eager` and `--no-enforce-eager`, `-tp`…), so a new
alias in a new vLLM is owned the day its snapshot is recorded. `--config FILE` is refused: a
file could set any owned option behind the operator's back, and the operator cannot read it.

Every other extraArgs item is read as vLLM would read it (core/engine/vllm_cli.py): an unknown flag,
a missing or mistyped value, a `"--max-num-seqs 64"` written as one item are refused with the
item named, before anything is deployed.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from rankguard_operator.core.engine.vllm_cli import VllmCli
from rankguard_operator.core.names import VLLM_HTTP_PORT

# The `--quantization` methods rankguard renders from spec.model.quantization on an unquantised
# checkpoint: the ones whose weight sizes the planner models (core/model/quantization.runtime_scheme).
RUNTIME_QUANTIZATION = ("fp8",)

# vLLM dest -> the spec field to use instead (None: not user-settable at all).
OWNED: dict[str, str | None] = {
    "model": "spec.model.name",
    "tensor_parallel_size": "spec.tensorParallelSize",
    "pipeline_parallel_size": "spec.pipelineParallelSize",
    "kv_cache_memory_bytes": "spec.memory.kvCacheMemoryBytes",
    "gpu_memory_utilization": "spec.memory.gpuMemoryUtilization",
    # vLLM 0.34's extensible KV cache (sized after warm-up) on or off: rankguard decides who sizes
    # the KV cache (core/engine/sizing_mode.py), and pins the bytes when the spec does. (A block
    # count override, `--num-gpu-blocks-override`, is accepted: the service is measured first and
    # pinned, core/engine/surface.MEASURE_FIRST.)
    "enable_extensible_kv_cache": "spec.memory.kvCacheMemoryBytes",
    "max_num_seqs": "spec.engine.maxNumSeqs",
    "max_model_len": "spec.engine.maxModelLen",
    "max_num_batched_tokens": "spec.engine.maxNumBatchedTokens",
    "block_size": "spec.engine.blockSize",
    "dtype": "spec.engine.dtype",
    "kv_cache_dtype": "spec.engine.kvCacheDtype",
    "enforce_eager": "spec.engine.enforceEager",
    # rankguard's CUDA-graph lever after an OOM during graph capture (core/policy/oom_levers.py);
    # the user's own capture sizes are `--cudagraph-capture-sizes` (then rankguard leaves it alone)
    "max_cudagraph_capture_size": None,
    # The weights' size depends on it: the planner must know (spec.model.quantization).
    "quantization": "spec.model.quantization",
    # One pod is one data-parallel replica of tp×pp GPUs; more replicas are spec.replicas.
    "data_parallel_size": "spec.replicas",
    "host": None,
    "port": None,
    "config": None,
}


# What rankguard renders on each pod of a group (spec.distributed): vLLM dest -> the field.
GROUP_OWNED: dict[str, str] = {
    "nnodes": "spec.distributed.podsPerGroup",
    "node_rank": "spec.distributed (each pod's node rank comes from its index)",
    "master_addr": "spec.distributed (the leader pod's name in the group's headless Service)",
    "master_port": "spec.distributed.rendezvousPort",
    "headless": "spec.distributed (every pod but the leader runs headless)",
    "distributed_timeout_seconds": "spec.distributed.timeoutSeconds",
}


def check_group_args(extra_args: Sequence[str], cli: VllmCli) -> list[str]:
    """One sentence per extraArgs item that sets what a group's pods get from spec.distributed."""
    messages = []
    seen: set[str] = set()
    for i, word in cli.walk(extra_args)[0]:
        o = word.option
        if o is not None and o.dest in GROUP_OWNED and o.dest not in seen:
            seen.add(o.dest)
            flag = word.key if word.key == o.name else f"{word.key} (vLLM reads it as {o.name})"
            messages.append(
                f"spec.engine.extraArgs[{i}] {flag} is set by rankguard on every pod of a group; "
                f"use {GROUP_OWNED[o.dest]} instead"
            )
    return messages


def owned_spellings(cli: VllmCli) -> dict[str, str]:
    """Every spelling of every owned option in this vLLM -> its dest."""
    return {s: dest for dest in OWNED for s in cli.spellings(dest)}


def _owned_message(dest: str, key: str, name: str) -> str:
    flag = key if key == name else f"{key} (vLLM reads it as {name})"
    instead = OWNED[dest]
    if dest == "config":
        return (
            f"{flag} is refused: a config file can set options rankguard manages (the KV budget, "
            "the split) where the operator cannot see them; put its settings in extraArgs and the "
            "spec fields instead"
        )
    if dest == "max_cudagraph_capture_size":
        return (
            f"{flag} is owned by rankguard: it lowers it after a CUDA OOM during CUDA-graph capture "
            "(spec.remediation.levers.minCudaGraphCaptureSize is its floor); to fix the capture "
            "sizes yourself use --cudagraph-capture-sizes, and rankguard leaves them alone"
        )
    if dest == "enable_extensible_kv_cache":
        return (
            f"{flag} is owned by rankguard: it decides who sizes the KV cache, vLLM after warm-up "
            "or rankguard in bytes (status.sizing says which and why); to pin the per-GPU budget in "
            f"bytes set {instead}, and rankguard turns vLLM's measurement off"
        )
    if instead is None:
        return (
            f"{flag} is owned by rankguard (vLLM must listen on $(POD_IP):{VLLM_HTTP_PORT} for "
            "the Service and the probes); remove it"
        )
    return f"{flag} is owned by rankguard; use {instead} instead"


def check_extra_args(extra_args: Sequence[str], cli: VllmCli) -> list[str]:
    """One actionable sentence per problem with `extra_args` for this vLLM; empty when all is well.

    Owned options come first (they are the ones a person must move into the spec); an owned
    item's own value problems are left out, since the item has to go anyway."""
    words, problems = cli.walk(extra_args)
    seen: set[str] = set()
    owned_at: set[int] = set()
    messages = []
    for i, word in words:
        o = word.option
        if o is not None and o.dest in OWNED:
            owned_at.add(i)
            if o.dest not in seen:
                seen.add(o.dest)
                messages.append(f"[{i}] " + _owned_message(o.dest, word.key, o.name))
    messages += [p for p in problems if not any(p.startswith(f"[{i}] ") for i in owned_at)]
    return [f"spec.engine.extraArgs{m}" for m in messages]


def conflicting_flags(extra_args: Sequence[str], cli: VllmCli) -> list[str]:
    """The owned options `extra_args` sets, by their usual spelling, in order of first use."""
    found: list[str] = []
    for _, word in cli.walk(extra_args)[0]:
        o = word.option
        if o is not None and o.dest in OWNED and o.name not in found:
            found.append(o.name)
    return found


# vLLM 0.33 (engine/arg_utils.py create_engine_config, config/vllm.py _set_cudagraph_sizes):
# `--max-cudagraph-capture-size` next to `--cudagraph-capture-sizes` whose largest size differs,
# or next to compilation-config's own max_cudagraph_capture_size, is a ValueError at start-up.
# So when the user sets capture sizes, rankguard renders no capture size of its own.
_CAPTURE_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def capture_sizes_flag(extra_args: Sequence[str], cli: VllmCli) -> str | None:
    """The extraArgs flag that sets CUDA-graph capture sizes (`--cudagraph-capture-sizes`, or
    compilation-config's cudagraph_capture_sizes / max_cudagraph_capture_size, whole or dotted),
    or None."""
    compilation: str | None = None
    for _, word in cli.walk(extra_args)[0]:
        o = word.option
        if o is not None and o.dest == "cudagraph_capture_sizes":
            return word.key
        if o is not None and o.dest == "compilation_config":
            compilation = compilation or word.key.split(".", 1)[0]
    doc = cli.json_object(extra_args, "compilation_config")  # the object vLLM reads, dotted items folded
    keys = [k for k in _CAPTURE_KEYS if doc is not None and k in doc]
    return f"{compilation} (its {', '.join(keys)})" if compilation is not None and keys else None


def chunked_prefill_off(extra_args: Sequence[str], cli: VllmCli) -> bool:
    """extraArgs turn chunked prefill off: vLLM 0.33 then refuses max_num_batched_tokens below
    max_model_len (config/scheduler.py verify_max_model_len)."""
    off = False
    for _, word in cli.walk(extra_args)[0]:
        if word.option is not None and word.option.dest == "enable_chunked_prefill":
            off = word.turns_off  # argparse keeps the last
    return off


def served_model_name(extra_args: Sequence[str], cli: VllmCli) -> str | None:
    """The name vLLM serves the model under and puts in its metrics' `model_name` label: the
    first value of the last `--served-model-name` in extraArgs (argparse keeps the last; vLLM's
    config/model.py get_served_model_name takes the first of the list), or None (then the model's
    own name is used)."""
    name: str | None = None
    for _, word in cli.walk(extra_args)[0]:
        if word.option is not None and word.option.dest == "served_model_name":
            name = word.values[0] if word.values else None
    return name or None
