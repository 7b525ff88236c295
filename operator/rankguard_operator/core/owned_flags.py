"""The vLLM flags rankguard owns, and the check that refuses extraArgs fighting them.

rankguard renders these flags itself (the budget, the split, the engine fields of the spec,
the listen address); an extraArgs item that sets one would silently override what rankguard
manages, so the spec is refused with the field to use instead.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from rankguard_operator.core.names import VLLM_HTTP_PORT

# --------------------------------------------------------------------------------------------
# Flags rankguard owns. Value: the spec field to use instead (None: not user-settable at all).

_OWNED: dict[str, str | None] = {
    "--model": "spec.model.name",
    "--tensor-parallel-size": "spec.tensorParallelSize",
    "-tp": "spec.tensorParallelSize",
    "--pipeline-parallel-size": "spec.pipelineParallelSize",
    "-pp": "spec.pipelineParallelSize",
    "--kv-cache-memory-bytes": "spec.memory.kvCacheMemoryBytes",
    "--gpu-memory-utilization": "spec.memory.gpuMemoryUtilization",
    # A block-count override silently defeats the per-GPU byte budget rankguard manages.
    "--num-gpu-blocks-override": "spec.memory.kvCacheMemoryBytes",
    "--max-num-seqs": "spec.engine.maxNumSeqs",
    "--max-model-len": "spec.engine.maxModelLen",
    "--max-num-batched-tokens": "spec.engine.maxNumBatchedTokens",
    "--block-size": "spec.engine.blockSize",
    "--dtype": "spec.engine.dtype",
    "--kv-cache-dtype": "spec.engine.kvCacheDtype",
    "--enforce-eager": "spec.engine.enforceEager",
    "--no-enforce-eager": "spec.engine.enforceEager",  # vLLM's BooleanOptionalAction spelling
    "--host": None,
    "--port": None,
}
OWNED_FLAGS: tuple[str, ...] = tuple(_OWNED)
_LONG_OWNED = tuple(f for f in OWNED_FLAGS if f.startswith("--"))
_OWNED_BY_NAME = {f.lstrip("-"): f for f in OWNED_FLAGS}


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _canonical(word: str) -> str | None:
    """The owned flag `word` sets, or None. vLLM's parser treats `_` and `-` alike in flag
    names (`--max_model_len`), takes `--flag=value`, and argparse accepts unambiguous prefixes
    of long flags (`--max-model`), so all of those count; so do one-dash long names and
    two-dash short ones (`-dtype`, `--tp`), which the CRD's own rule refuses too."""
    if not word.startswith("-") or _is_number(word):
        return None
    name = word.split("=", 1)[0].lstrip("-").replace("_", "-")
    if not name:
        return None
    if name in _OWNED_BY_NAME:
        return _OWNED_BY_NAME[name]
    if word.startswith("--") and len(name) > 2:
        prefixed = [f for f in _LONG_OWNED if f[2:].startswith(name)]
        if len(prefixed) == 1:
            return prefixed[0]
    return None


def conflicting_flags(extra_args: Sequence[str]) -> list[str]:
    """Owned flags (canonical spelling, first occurrence order) that `extra_args` sets."""
    found: list[str] = []
    for arg in extra_args:
        # People write ["--max-model-len 4096"] as one item; vLLM would choke on it, and it
        # must not slip past this check either, so every word is looked at.
        for word in arg.split():
            flag = _canonical(word)
            if flag is not None and flag not in found:
                found.append(flag)
    return found


def extra_args_conflicts(extra_args: Sequence[str]) -> list[str]:
    """One actionable sentence per owned flag that `extra_args` sets; empty when all is well."""
    messages = []
    for flag in conflicting_flags(extra_args):
        instead = _OWNED[flag]
        if instead is None:
            messages.append(
                f"spec.engine.extraArgs sets {flag}, which rankguard owns (vLLM must listen on "
                f"$(POD_IP):{VLLM_HTTP_PORT} for the Service and the probes); remove it"
            )
        else:
            messages.append(f"spec.engine.extraArgs sets {flag}, which rankguard owns; use {instead} instead")
    return messages
