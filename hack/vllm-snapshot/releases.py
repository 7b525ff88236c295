"""Which recogniser keys a release may lack, and why: the `absent` map of its formats.json.

The recognisers were written against STRICT_VERSION (0.33.0): it has every key except those that
came with a later release. Any other release may lack a key only for a reason listed here, each
checked in that release's installed source (`expected_absent`), in both directions:

- ABSENT_MESSAGES: an OLDER release lacks a message that came later (confirmed by grepping its
  source for the message's words, or its torch/lib/*.so for a torch message, when it was listed);
- REMOVED_MESSAGES: a NEWER release removed the code that printed it; the file named with the
  reason must be gone from the installed release (the snapshot stops otherwise).

A key listed here that the release has, or a key it lacks that is not listed, stops the snapshot:
the fragment moved or was reworded, and the recognisers are re-read, never guessed.
"""

from __future__ import annotations

import sys
from pathlib import Path

STRICT_VERSION = "0.33.0"

_NO_EXTERNAL_WEIGHTS = dict.fromkeys(
    ("startup_external_weights", "startup_free_external"),
    "vllm/v1/worker/utils.py: request_memory() has no external_weight_memory parameter yet; "
    "its only refusal is the free-memory one (startup_free_too_low)",
)
_NO_OUTSIDE_ALLOCATOR_OOM = (
    'torch {torch} (vLLM {vllm}\'s): no "ran out of memory outside" string in any torch/lib/*.so; '
    "the message came with a later torch"
)
# vLLM 0.34's extensible KV cache (sized after warm-up): its lines, which no earlier release prints
EXTENSIBLE_MODULE = "vllm/v1/worker/extensible_kv_cache.py"
EXTENSIBLE_KEYS = (
    "memory_after_warmup",
    "utilization_withholds",
    "extensible_kv_disabled",
    "extensible_kv_extended",
)
_NO_EXTENSIBLE_KV_CACHE = dict.fromkeys(
    EXTENSIBLE_KEYS,
    f"no extensible KV cache yet ({EXTENSIBLE_MODULE} came with vLLM 0.34): "
    "the KV cache is sized from the profile run's estimate",
)
# Older releases: key -> why (the evidence: that release's source, read when the entry was made;
# the extensible keys are checked by the module being absent).
ABSENT_MESSAGES: dict[str, dict[str, str]] = {
    vllm: {
        **(_NO_EXTERNAL_WEIGHTS if vllm in ("0.30.0", "0.31.0") else {}),
        **(
            {}
            if torch is None
            else {"torch_oom_outside_allocator": _NO_OUTSIDE_ALLOCATOR_OOM.format(torch=torch, vllm=vllm)}
        ),
        **_NO_EXTENSIBLE_KV_CACHE,
    }
    for vllm, torch in (("0.30.0", "2.13.0"), ("0.31.0", "2.13.0"), ("0.32.0", "2.13.0"), ("0.33.0", None))
}
# the strict release lacks only what came later
assert set(ABSENT_MESSAGES[STRICT_VERSION]) == set(EXTENSIBLE_KEYS)

# Newer releases: key -> (a file of the strict release that printed it and this one no longer
# has, why). vLLM 0.34 removed the V1 GPU model runner; the V2 runner is the only GPU runner.
_V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
_NO_V1_RUNNER = f"the V1 GPU model runner that logged it ({_V1_RUNNER}) is removed; "
_V2_CAPTURE = "vllm/v1/worker/gpu/cudagraph_utils.py"
REMOVED_MESSAGES: dict[str, dict[str, tuple[str, str]]] = {
    "0.34.0": {
        "model_load_start": (
            _V1_RUNNER,
            _NO_V1_RUNNER + "the V2 runner (vllm/v1/worker/gpu/model_runner.py) starts loading with "
            "model_load_start_v2",
        ),
        **dict.fromkeys(
            ("cuda_graph_profiling", "cuda_graph_estimated"),
            (
                _V1_RUNNER,
                _NO_V1_RUNNER
                + f"the V2 runner's graph-memory estimate (profile_cudagraph_memory, {_V2_CAPTURE}) "
                "logs no line of its own",
            ),
        ),
        **dict.fromkeys(
            ("cuda_graph_capture_untraced", "cuda_graph_capture_traced"),
            (
                _V1_RUNNER,
                _NO_V1_RUNNER + "the V2 runner's capture logs no torch-profiler line; its progress bar "
                f"(cuda_graph_capture_bar, {_V2_CAPTURE}) starts the capture",
            ),
        ),
    },
}


def expected_absent(site: Path, version: str) -> dict[str, str]:
    """key -> why `version` has no such message, each reason's evidence checked in `site`."""
    older = ABSENT_MESSAGES.get(version, {})
    if set(older) & set(EXTENSIBLE_KEYS) and (site / EXTENSIBLE_MODULE).exists():
        sys.exit(f"snapshot: vLLM {version} has {EXTENSIBLE_MODULE}: its lines are not absent; re-read it")
    removed: dict[str, str] = {}
    for key, (gone, why) in REMOVED_MESSAGES.get(version, {}).items():
        if (site / gone).exists():
            sys.exit(f"snapshot: vLLM {version} still has {gone}, listed as removed for {key!r}; re-read it")
        removed[key] = why
    return {**older, **removed}
