"""What a GPU scenario says: per rank, what a serving setup really costs on its GPUs.

A scenario (a YAML file under `scenarios/`, read by `scenario_file`) gives, per rank, the
CUDA context, communicators, weights, the activation peak that vLLM's `profile_run`
measures, CUDA graphs, communicator memory that only appears once serving starts, and the
logits buffer that grows with the running batch. Every number cites where it comes from
(docs/scenarios.md explains them). `engine_memory` replays vLLM over these numbers.

This is the WORLD, not rankguard's model of it: nothing here is imported by, or imports,
the operator or the agent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

# "other_process": memory other processes of the vLLM container hold on this rank's GPU before
# the workers start (the API server / engine core touching cuda:0): outside vLLM's budget.
# "late_other_process": memory another process of the container takes on the GPU after the
# workers' memory snapshot and before the KV cache is allocated (vLLM's budget, sized from the
# snapshot, cannot see it: allocating the KV cache is what runs out).
# "sampler": the sampler's working set beyond the logits, per dummy request (top-k/top-p sort
# of [num_reqs, vocab]: the sorted copy, its indices, the probabilities), at the defaults'
# min(max_num_seqs, max_num_batched_tokens) dummy requests. vLLM's profile_run runs the dummy
# sampler (so the profile peak holds it), the warm-up after graph capture runs it again, and
# every decode step holds it for its running sequences (last pipeline stage only).
PHASES = (
    "other_process",
    "init",
    "weights",
    "profile",
    "cuda_graph",
    "serving",
    "late_other_process",
    "sampler",
)
LOGITS_MODES = ("gather", "all_gather")
# "max_num_seqs": bytes at the defaults' dummy requests, min(max_num_seqs, max_num_batched_tokens),
# scaled by the flags' (the last pipeline stage's dummy sampler in profile_run)
# "max_cudagraph_capture_size": bytes at the defaults' largest captured size, scaled by the
# configuration's (CUDA graphs share one memory pool and vLLM captures the largest first, so
# the pool holds the largest graph's buffers and the smaller ones reuse them)
SCALES_WITH = ("max_num_batched_tokens", "dtype", "max_num_seqs", "max_cudagraph_capture_size")
DISABLED_BY = ("disable_custom_all_reduce", "enforce_eager")


class ScenarioError(ValueError):
    """A scenario file is missing, malformed, or contradicts itself."""


# ---------------------------------------------------------------------------------------------
# Sizes


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KiB": KIB,
    "MiB": MIB,
    "GiB": GIB,
    "TiB": 1 << 40,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}


def parse_bytes(value: Any, where: str = "value") -> int:
    """An integer number of bytes, or a string like "1.79GiB" / "575 MiB" (rounded)."""
    if isinstance(value, bool):
        raise ScenarioError(f"{where}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ScenarioError(f"{where}: a size cannot be negative ({value})")
        return value
    if isinstance(value, float):
        if value < 0 or not math.isfinite(value):
            raise ScenarioError(f"{where}: a size must be finite and >= 0 ({value})")
        return round(value)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return round(float(m.group(1)) * _SIZE_UNITS[m.group(2)])
    raise ScenarioError(f"{where}: expected bytes (e.g. 85899345920 or '79.14GiB'), got {value!r:.60}")


def gib(nbytes: float) -> float:
    return nbytes / GIB


# ---------------------------------------------------------------------------------------------
# The scenario's data


@dataclass(frozen=True)
class GpuSpec:
    name: str
    total_bytes: int
    source: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    aliases: tuple[str, ...]
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_position_embeddings: int
    source: str
    # config.json's `architectures` (e.g. LlamaForCausalLM); () when the scenario does not say
    architectures: tuple[str, ...] = ()

    def matches(self, model: str) -> bool:
        wanted = model.rstrip("/").lower()
        names = [self.name.lower(), *(a.lower() for a in self.aliases)]
        tails = [n.rsplit("/", 1)[-1] for n in names]
        return wanted in names or wanted.rsplit("/", 1)[-1] in tails


@dataclass(frozen=True)
class EngineDefaults:
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    source: str


@dataclass(frozen=True)
class LogitsSpec:
    mode: str  # "all_gather" (vLLM v1): full-vocab logits on every rank of the last stage;
    # "gather" (vLLM <= 0.6, v0): on TP rank 0 of the last stage only
    dtype_bytes: int
    source: str


@dataclass(frozen=True)
class Component:
    """One thing that sits in GPU memory, per rank, allocated at one phase of vLLM's life."""

    name: str
    phase: str
    default_bytes: int
    rank_bytes: Mapping[int, int]
    source: str
    scales_with: str | None = None
    disabled_by: str | None = None
    # cuda_graph only: False when vLLM's estimate of the graph pool (profile_cudagraph_memory,
    # which extrapolates from the two largest graphs, vllm/v1/worker/gpu_model_runner.py:6268)
    # misses these bytes, so the KV budget leaves no room for them
    profiled: bool = True

    def bytes_for(self, rank: int) -> int:
        return self.rank_bytes.get(rank, self.default_bytes)


@dataclass(frozen=True)
class LoadPattern:
    """Demand in running sequences: idle, a ramp in `ramp_levels` steps, a hold at the peak."""

    peak_running_seqs: int
    tokens_per_seq: int
    idle_seconds: float
    ramp_seconds: float
    ramp_levels: int
    hold_seconds: float
    source: str

    def demand_levels(self) -> list[int]:
        return [
            max(1, round(self.peak_running_seqs * i / self.ramp_levels))
            for i in range(1, self.ramp_levels + 1)
        ]

    @property
    def cycle_seconds(self) -> float:
        return self.idle_seconds + self.ramp_seconds + self.hold_seconds


@dataclass(frozen=True)
class HostMemory:
    """The engine process's resident host memory, as the container's cgroup would count it."""

    baseline_bytes: int
    after_load_bytes: int
    source: str


DEFAULT_DOWNLOAD_BYTES_PER_SECOND = 1000**3  # 1 GB/s


@dataclass(frozen=True)
class DownloadSpec:
    """How fast the model's weights come into the Hugging Face cache when they are not there."""

    bytes_per_second: int = DEFAULT_DOWNLOAD_BYTES_PER_SECOND
    source: str = (
        "the sandbox's default, 1 GB/s: a node's fast link to the Hugging Face Hub or a mirror "
        "(a 70B bf16 checkpoint, 141 GB, takes 141 s)"
    )

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_second


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    gpu: GpuSpec
    model: ModelSpec
    tensor_parallel_size: int
    pipeline_parallel_size: int
    topology_source: str
    defaults: EngineDefaults
    logits: LogitsSpec
    components: tuple[Component, ...]
    load: LoadPattern
    host_memory: HostMemory | None = None
    sources: Mapping[str, str] = field(default_factory=dict)
    path: str | None = None
    # The model's config.json: the fake vLLM "downloads" it (header-only safetensors) into the
    # Hugging Face cache when it serves a repo id. None: it writes nothing.
    model_config: Mapping[str, Any] | None = None
    # How long that "download" takes (unscaled seconds = the real checkpoint's bytes / rate).
    download: DownloadSpec = field(default_factory=DownloadSpec)
    # The nodes (pods) the world spans (vLLM's --nnodes): node r holds global ranks
    # r × local_world_size … (r + 1) × local_world_size − 1, on its own GPUs 0, 1, …
    nnodes: int = 1
    # The world of a model whose weights do not fit its GPUs at this TP (every flag fails
    # loading them); the loader checks the opposite of a world that fits at rest.
    weights_do_not_fit: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        return self.world_size // self.nnodes

    def node_ranks(self, node_rank: int) -> range:
        """The global ranks node `node_rank` holds (vLLM: node_rank × local_world_size + local rank)."""
        first = node_rank * self.local_world_size
        return range(first, first + self.local_world_size)

    def pp_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def is_last_stage(self, rank: int) -> bool:
        return self.pp_rank(rank) == self.pipeline_parallel_size - 1

    def layers_on_stage(self, pp_rank: int) -> int:
        """Decoder layers held by one pipeline stage.

        Layers are split evenly; leftover layers go to the stages just before the last one,
        because the last stage also carries the final norm, the LM head and the sampler.
        """
        pp = self.pipeline_parallel_size
        base, extra = divmod(self.model.num_layers, pp)
        counts = [base] * pp
        for i in range(extra):  # extra > 0 only when pp > 1
            counts[-2 - i] += 1
        return counts[pp_rank]

    def phase_bytes(self, rank: int, phase: str) -> int:
        """The scenario's bytes for one phase at its own defaults (no flag adjustments)."""
        return sum(c.bytes_for(rank) for c in self.components if c.phase == phase)

    def comm_init_bytes(self, rank: int) -> int:
        """What creating the CUDA context and the communicators costs on this rank's GPU.

        The process kubelet writes it into device.json (`comm_init_bytes`) so that the
        agent's probe pays the same cost the engine pays before its memory snapshot.
        """
        return self.phase_bytes(rank, "init")
