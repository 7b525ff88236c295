"""Which phase of its start-up (or serving) vLLM's engine was in: PURE, fed line by line.

vLLM 0.33's engine core runs one order (vllm/v1/engine/core.py): each worker loads the weights,
then `determine_available_memory` (the profile run, and the CUDA graphs' memory profiled on a
minimal KV cache), then the KV cache is allocated (`initialize_from_config`), then
`compile_or_warm_up_model` captures the CUDA graphs and warms the sampler up, then it serves.

vLLM 0.34 (no V1 GPU model runner; the V2 runner's lines) with its extensible KV cache runs:
load (`Loading model from scratch` .. `Model loading took`), the profile run, reserve the KV
cache's address range (`Available KV cache memory` .. : `initialize_from_config`), warm-up and
capture (`run_kv_cache_sizing_warmup`, the V2 runner's capture bar .. `Graph capturing finished`,
then the sampler's warm-up), measure (`measure_kv_cache_blocks` ends with `Memory after warmup`;
it allocates nothing, so it has no phase of its own: the sampler warm-up's stands), extend (the
engine core's minimum over ranks, `GPU KV cache size`, then each worker commits it: `Extended KV
cache to`), serve. They map onto the same six phases (termination.PHASES): reserve and extend are
the KV cache's allocation, the sizing warm-up runs the profile's largest step again. Without the
extensible KV cache (`--kv-cache-memory-bytes`, no VMM) 0.34 keeps 0.33's order and lines. Two
witnesses say where a rank was when it ran out of memory:

- The phase markers: lines vLLM logs as a phase begins or ends (`MARKERS`; their vLLM source,
  file:line, is in rankguard_operator/vllm_snapshots/*/formats.json under the same keys, and
  tests/unit/agent/wire/test_phases.py renders every recorded template through `marker_phase`).
  Most are logged once for the whole engine (vLLM's `info_once`, by the first rank) or by the
  engine core, so a marker from a worker's line sets that rank's phase and a marker from any other
  line (the engine core's, an unprefixed one) sets every rank's. A rank that said nothing itself
  follows the last marker any rank printed.
- The traceback the failing worker prints: its frames name the step (`load_model`,
  `profile_run`, `capture_model`, ...). The innermost frame that names a phase wins over the
  markers, within the step that encloses it: `_dummy_run` serves the profile run, the graph
  capture and the warm-ups alike and decides nothing; the sampler's dummy pass inside
  `profile_run` is the profile; `execute_model` inside a warm-up is not serving; the minimal KV
  cache allocated to profile the graphs is the graphs' phase.

Unknown stays None (the operator then does what it did before phases). Standard library only:
it runs inside the vLLM container and is imported by the operator.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rankguard_agent.wire.termination import (
    PHASE_CUDA_GRAPHS,
    PHASE_KV_ALLOCATION,
    PHASE_PROFILE,
    PHASE_SAMPLER_WARMUP,
    PHASE_SERVING,
    PHASE_WEIGHTS,
)

# (snapshot key, a fragment of the line, the phase the engine is in from that line on). Searched
# anywhere in the line, so vLLM's log prefix and a progress bar's carriage returns do not matter.
MARKERS: tuple[tuple[str, str, str], ...] = (
    ("model_load_start", "Starting to load model ", PHASE_WEIGHTS),
    ("model_load_start_v2", "Loading model from scratch", PHASE_WEIGHTS),
    # the weights are in: the profile run is next
    ("model_loading", "Model loading took ", PHASE_PROFILE),
    # the memory profile captures the CUDA graphs once, on a minimal KV cache, to measure them
    ("cuda_graph_profiling", "Profiling CUDA graph memory: ", PHASE_CUDA_GRAPHS),
    ("cuda_graph_estimated", "Estimated CUDA graph memory: ", PHASE_PROFILE),
    # the profile's result: the KV cache is allocated next
    ("available_kv_memory", "Available KV cache memory: ", PHASE_KV_ALLOCATION),
    ("kv_bytes_reserved", "memory for KV Cache as specified by kv_cache_memory_bytes", PHASE_KV_ALLOCATION),
    ("kv_cache_size", "KV cache size: ", PHASE_KV_ALLOCATION),  # the engine core's, for every rank
    ("cuda_graph_capture_bar", "Capturing CUDA graphs (", PHASE_CUDA_GRAPHS),
    ("cuda_graph_capture_untraced", "Torch profiler disabled for CUDA graph capture", PHASE_CUDA_GRAPHS),
    ("cuda_graph_capture_traced", "Torch profiler enabled for CUDA graph capture", PHASE_CUDA_GRAPHS),
    # printed after the capture, before the sampler's warm-up
    ("cuda_graph_captured", "Graph capturing finished in ", PHASE_SAMPLER_WARMUP),
    ("cuda_graph_pool", "CUDA graph pool memory: ", PHASE_SAMPLER_WARMUP),
    ("worker_memory_report", "Current kv cache memory in use is", PHASE_SAMPLER_WARMUP),
    # vLLM 0.34's extensible KV cache: the measurement after warm-up is done, the minimum over
    # ranks is committed next (the engine core's `kv_cache_size` then says so for every rank),
    # and the worker's extension is followed by its KV connector's set-up
    ("memory_after_warmup", "Memory after warmup: ", PHASE_KV_ALLOCATION),
    ("extensible_kv_extended", "Extended KV cache to ", PHASE_KV_ALLOCATION),
    ("init_engine_took", "init engine (profile, create kv cache, warmup model) took", PHASE_SERVING),
    ("api_server_start", "Starting vLLM server on ", PHASE_SERVING),
)

# The fragments of the markers that begin the weights' load (a worker's init memory snapshot was
# taken just before: the launcher keeps each rank's free memory then, sampler.mark_load).
LOAD_MARKERS: tuple[str, ...] = tuple(fragment for _, fragment, phase in MARKERS if phase == PHASE_WEIGHTS)

# A traceback frame's function in vLLM's source -> the phase it is the work of.
FRAME_PHASES: dict[str, str] = {
    "load_model": PHASE_WEIGHTS,
    "load_weights": PHASE_WEIGHTS,
    "initialize_model": PHASE_WEIGHTS,
    "determine_available_memory": PHASE_PROFILE,
    "profile_run": PHASE_PROFILE,
    "profile_cudagraph_memory": PHASE_CUDA_GRAPHS,
    "_profile_cudagraph_memory": PHASE_CUDA_GRAPHS,
    "initialize_from_config": PHASE_KV_ALLOCATION,
    "initialize_kv_cache": PHASE_KV_ALLOCATION,
    "initialize_kv_cache_tensors": PHASE_KV_ALLOCATION,
    "_allocate_kv_cache_tensors": PHASE_KV_ALLOCATION,
    "capture_model": PHASE_CUDA_GRAPHS,
    "_capture_cudagraphs": PHASE_CUDA_GRAPHS,
    "_warmup_and_capture": PHASE_CUDA_GRAPHS,
    # vLLM 0.34's extensible KV cache: the largest steps run again to measure their transient peak
    # (the profile's work), then the measured size is committed on every worker
    "run_kv_cache_sizing_warmup": PHASE_PROFILE,
    "finalize_extensible_kv_cache": PHASE_KV_ALLOCATION,
    "extend_kv_cache": PHASE_KV_ALLOCATION,
    "_dummy_sampler_run": PHASE_SAMPLER_WARMUP,
    "_dummy_pooler_run": PHASE_SAMPLER_WARMUP,
    "execute_model": PHASE_SERVING,
    "sample_tokens": PHASE_SERVING,
}
# Start-up steps that name no phase of their own but run the model: a serving frame inside one is a
# warm-up (V2's warmup_kernels calls execute_model), not serving.
_STARTUP_CONTEXT = frozenset(
    {
        "compile_or_warm_up_model",
        "_compile_or_warm_up_model",
        "kernel_warmup",
        "warmup_kernels",
        "_initialize_kv_caches",
    }
)
# Before any phase: the worker's device set-up and vLLM's start-up memory check.
_BEFORE_PHASES = frozenset({"init_device", "request_memory"})
# (outer, inner): the inner step's work done for the outer one belongs to the outer phase.
_OWNED = frozenset({(PHASE_PROFILE, PHASE_SAMPLER_WARMUP), (PHASE_CUDA_GRAPHS, PHASE_KV_ALLOCATION)})

_FRAME = re.compile(r'File "([^"]*)", line \d+, in (\w+)')
_TRACEBACK = "Traceback (most recent call last):"


def marker_phase(line: str) -> str | None:
    """The phase the engine is in from this line on, when the line is a phase marker."""
    for _, fragment, phase in MARKERS:
        if fragment in line:
            return phase
    return None


def frame_function(line: str) -> str | None:
    """The function of a traceback frame line in vLLM's source ('File ".../vllm/...", line N, in f')."""
    m = _FRAME.search(line)
    if m is None or "vllm/" not in m.group(1).replace("\\", "/"):
        return None
    return m.group(2)


def frames_phase(functions: Sequence[str]) -> str | None:
    """The phase a traceback's frames (outermost first, as Python prints them) name, or None."""
    phase: str | None = None
    in_startup = False
    for func in functions:
        if func in _BEFORE_PHASES:
            return None
        if func in _STARTUP_CONTEXT:
            in_startup = True
        found = FRAME_PHASES.get(func)
        if found is None or (found == PHASE_SERVING and in_startup) or (phase, found) in _OWNED:
            continue
        phase = found  # the innermost frame that names a phase wins
        in_startup = in_startup or found != PHASE_SERVING
    return phase


@dataclass
class _Seen:
    seq: int
    phase: str


class PhaseTracker:
    """The phase of every rank, from the engine's lines in the order they came.

    `rank_of` says which rank printed a line (None: the engine core, or no rank known); it is
    asked only for markers and traceback lines. `phase(rank)` is where that rank was at the last
    line fed: its current traceback's frames when they name a phase, else the latest marker.
    """

    def __init__(self, rank_of: Callable[[str], int | None] | None = None) -> None:
        self._rank_of = rank_of if rank_of is not None else (lambda _line: None)
        self._seq = 0
        self._shared: _Seen | None = None  # markers of no rank: every rank's
        self._own: dict[int, _Seen] = {}
        self._frames: dict[int | None, list[str]] = {}

    def on_line(self, line: str) -> None:
        phase = marker_phase(line)
        if phase is not None:
            self._seq += 1
            rank = self._rank_of(line)
            seen = _Seen(self._seq, phase)
            if rank is None:
                self._shared = seen
            else:
                self._own[rank] = seen
            self._frames.pop(rank, None)  # the rank moved on: an earlier traceback is history
            return
        if _TRACEBACK in line:
            self._frames[self._rank_of(line)] = []
            return
        func = frame_function(line)
        if func is not None:
            self._frames.setdefault(self._rank_of(line), []).append(func)

    def phase(self, rank: int | None) -> str | None:
        """Where `rank` was (None: a line of no known rank); None when nothing says."""
        frames = self._frames.get(rank)
        if frames:
            if any(f in _BEFORE_PHASES for f in frames):
                return None
            found = frames_phase(frames)
            if found is not None:
                return found
        candidates = [s for s in (self._own.get(rank) if rank is not None else None, self._shared) if s]
        if not candidates:
            # vLLM logs most markers on its first rank only: they stand for the ranks that said nothing
            candidates = list(self._own.values())
        if not candidates:
            return None
        return max(candidates, key=lambda s: s.seq).phase
