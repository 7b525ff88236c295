"""GPU scenarios: the simulated world's ground truth, and vLLM's memory behaviour over it.

A scenario (a YAML file under `scenarios/`) says, per rank, what a serving setup really
costs on its GPUs: CUDA context, communicators, weights, the activation peak that vLLM's
`profile_run` measures, CUDA graphs, communicator memory that only appears once serving
starts, and the logits buffer that grows with the running batch. Every number cites where
it comes from (docs/scenarios.md explains them).

`EngineMemoryModel` replays vLLM v1's start-up and serving sequence over a `Ledger` (what
is free on each GPU). The fake vLLM runs it over the simulated GPU files; `outcome()` runs
it over a pure ledger, so a benchmark asks the same question the fake answers: with these
flags, does this scenario crash, on which rank, and how much KV cache does it keep?

This is the WORLD, not rankguard's model of it: nothing here is imported by, or imports,
the operator or the agent.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import yaml

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

SCENARIO_ENV = "RANKGUARD_SIM_SCENARIO"

PHASES = ("init", "weights", "profile", "cuda_graph", "serving")
LOGITS_MODES = ("gather", "all_gather")
SCALES_WITH = ("max_num_batched_tokens", "dtype")
DISABLED_BY = ("disable_custom_all_reduce", "enforce_eager")

# vLLM's accepted values (engine arg choices); anything else is refused before start-up.
DTYPE_BYTES = {"half": 2, "float16": 2, "bfloat16": 2, "float": 4, "float32": 4}
DTYPES = ("auto", *DTYPE_BYTES)
KV_CACHE_DTYPE_BYTES = {"bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_BYTES)
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)

# Outcome reasons (the world's words; the agent recognises the printed messages instead).
CUDA_OOM = "CUDAOutOfMemory"
STARTUP_FREE_MEMORY = "FreeMemoryBelowRequested"
KV_CACHE_TOO_SMALL = "KVCacheTooSmall"
NO_KV_MEMORY = "NoKVCacheMemory"
GPU_LOST = "GpuLost"


class ScenarioError(ValueError):
    """A scenario file is missing, malformed, or contradicts itself."""


class EngineConfigError(ValueError):
    """The flags cannot describe an engine for this scenario (vLLM would refuse to start)."""


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
    mode: str  # "gather": full-vocab logits on TP rank 0 of the last stage; "all_gather": on all
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

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

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


# ---------------------------------------------------------------------------------------------
# Loading and validation


class _Reader:
    """Typed access to one YAML mapping, with errors that say where in which file."""

    def __init__(self, doc: Any, where: str) -> None:
        if not isinstance(doc, dict):
            raise ScenarioError(f"{where}: expected a mapping, got {type(doc).__name__}")
        self.doc: dict[str, Any] = doc
        self.where = where
        self.used: set[str] = set()

    def _get(self, key: str, required: bool) -> Any:
        self.used.add(key)
        if key not in self.doc or self.doc[key] is None:
            if required:
                raise ScenarioError(f"{self.where}.{key}: required")
            return None
        return self.doc[key]

    def sub(self, key: str) -> _Reader:
        return _Reader(self._get(key, True), f"{self.where}.{key}")

    def opt_sub(self, key: str) -> _Reader | None:
        value = self._get(key, False)
        return None if value is None else _Reader(value, f"{self.where}.{key}")

    def text(self, key: str, default: str | None = None) -> str:
        value = self._get(key, default is None)
        if value is None:
            return default or ""
        if not isinstance(value, str) or not value.strip():
            raise ScenarioError(f"{self.where}.{key}: expected non-empty text")
        return value.strip()

    def source(self) -> str:
        value = self._get("source", True)
        if not isinstance(value, str) or len(value.strip()) < 3:
            raise ScenarioError(f"{self.where}.source: every number needs a source (non-empty text)")
        return " ".join(value.split())

    def integer(self, key: str, minimum: int = 0, default: int | None = None) -> int:
        value = self._get(key, default is None)
        if value is None:
            assert default is not None
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise ScenarioError(f"{self.where}.{key}: expected an integer, got {value!r:.40}")
        if value < minimum:
            raise ScenarioError(f"{self.where}.{key}: must be >= {minimum}, got {value}")
        return value

    def number(self, key: str, low: float, high: float) -> float:
        value = self._get(key, True)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ScenarioError(f"{self.where}.{key}: expected a number, got {value!r:.40}")
        if not low <= float(value) <= high:
            raise ScenarioError(f"{self.where}.{key}: must be within [{low}, {high}], got {value}")
        return float(value)

    def size(self, key: str, required: bool = True) -> int | None:
        value = self._get(key, required)
        return None if value is None else parse_bytes(value, f"{self.where}.{key}")

    def choice(self, key: str, choices: Sequence[str], default: str | None = None) -> str | None:
        value = self._get(key, False)
        if value is None:
            return default
        if value not in choices:
            raise ScenarioError(f"{self.where}.{key}: must be one of {', '.join(choices)}; got {value!r:.40}")
        return str(value)

    def done(self) -> None:
        unknown = sorted(set(self.doc) - self.used)
        if unknown:
            raise ScenarioError(f"{self.where}: unknown field(s) {', '.join(unknown)}")


def _component(doc: Any, where: str, world_size: int) -> Component:
    r = _Reader(doc, where)
    name = r.text("name")
    phase = r.choice("phase", PHASES)
    if phase is None:
        raise ScenarioError(f"{where}.phase: required (one of {', '.join(PHASES)})")
    default = r.size("bytes", required=False) or 0
    ranks_doc = r._get("ranks", False) or {}
    if not isinstance(ranks_doc, dict):
        raise ScenarioError(f"{where}.ranks: expected a mapping of rank -> bytes")
    rank_bytes: dict[int, int] = {}
    for key, value in ranks_doc.items():
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < world_size:
            raise ScenarioError(f"{where}.ranks: rank {key!r} is outside 0..{world_size - 1}")
        rank_bytes[key] = parse_bytes(value, f"{where}.ranks[{key}]")
    if "bytes" not in r.doc and not rank_bytes:
        raise ScenarioError(f"{where}: give `bytes` (every rank) and/or `ranks` (per rank)")
    component = Component(
        name=name,
        phase=phase,
        default_bytes=default,
        rank_bytes=rank_bytes,
        source=r.source(),
        scales_with=r.choice("scales_with", SCALES_WITH),
        disabled_by=r.choice("disabled_by", DISABLED_BY),
    )
    r.done()
    return component


def parse_scenario(doc: Any, where: str = "scenario", path: str | None = None) -> Scenario:
    """Validate a loaded YAML document and build a Scenario (raises ScenarioError)."""
    r = _Reader(doc, where)
    name = r.text("name")
    description = r.text("description")
    sources_doc = r._get("sources", False) or {}
    if not isinstance(sources_doc, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in sources_doc.items()
    ):
        raise ScenarioError(f"{where}.sources: expected a mapping of key -> citation text")

    g = r.sub("gpu")
    total = g.size("total_bytes")
    assert total is not None
    if total < GIB:
        raise ScenarioError(f"{where}.gpu.total_bytes: {total} bytes is not a GPU")
    gpu = GpuSpec(name=g.text("name"), total_bytes=total, source=g.source())
    g.done()

    m = r.sub("model")
    aliases = m._get("aliases", False) or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ScenarioError(f"{where}.model.aliases: expected a list of names")
    dtype_name = m.choice("dtype", ("bfloat16", "float16"), default="bfloat16")
    model = ModelSpec(
        name=m.text("name"),
        aliases=tuple(aliases),
        vocab_size=m.integer("vocab_size", 1),
        num_layers=m.integer("num_layers", 1),
        num_kv_heads=m.integer("num_kv_heads", 1),
        head_dim=m.integer("head_dim", 1),
        dtype_bytes=DTYPE_BYTES[dtype_name or "bfloat16"],
        max_position_embeddings=m.integer("max_position_embeddings", 1),
        source=m.source(),
    )
    m.done()

    t = r.sub("topology")
    tp = t.integer("tensor_parallel_size", 1)
    pp = t.integer("pipeline_parallel_size", 1)
    topology_source = t.source()
    t.done()
    world = tp * pp
    if pp > model.num_layers:
        raise ScenarioError(f"{where}.topology: {pp} pipeline stages for {model.num_layers} layers")

    d = r.sub("engine_defaults")
    defaults = EngineDefaults(
        gpu_memory_utilization=d.number("gpu_memory_utilization", 0.01, 1.0),
        max_num_seqs=d.integer("max_num_seqs", 1),
        max_num_batched_tokens=d.integer("max_num_batched_tokens", 1),
        block_size=d.integer("block_size", 1),
        source=d.source(),
    )
    if defaults.block_size not in BLOCK_SIZES:
        raise ScenarioError(f"{where}.engine_defaults.block_size: must be one of {BLOCK_SIZES}")
    d.done()

    lg = r.sub("logits")
    logits = LogitsSpec(
        mode=lg.choice("mode", LOGITS_MODES) or "",
        dtype_bytes=lg.integer("dtype_bytes", 1, default=4),
        source=lg.source(),
    )
    if not logits.mode:
        raise ScenarioError(f"{where}.logits.mode: required (one of {', '.join(LOGITS_MODES)})")
    lg.done()

    comps_doc = r._get("memory", True)
    if not isinstance(comps_doc, list) or not comps_doc:
        raise ScenarioError(f"{where}.memory: expected a non-empty list of components")
    components = tuple(_component(c, f"{where}.memory[{i}]", world) for i, c in enumerate(comps_doc))
    names = [c.name for c in components]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{where}.memory: component names must be unique")
    for phase in ("init", "weights"):
        if not any(c.phase == phase for c in components):
            raise ScenarioError(f"{where}.memory: needs at least one `{phase}` component")

    ld = r.sub("load")
    load = LoadPattern(
        peak_running_seqs=ld.integer("peak_running_seqs", 1),
        tokens_per_seq=ld.integer("tokens_per_seq", 1),
        idle_seconds=ld.number("idle_seconds", 0.0, 3600.0),
        ramp_seconds=ld.number("ramp_seconds", 0.0, 3600.0),
        ramp_levels=ld.integer("ramp_levels", 1),
        hold_seconds=ld.number("hold_seconds", 0.0, 3600.0),
        source=ld.source(),
    )
    ld.done()

    hm = r.opt_sub("host_memory")
    host: HostMemory | None = None
    if hm is not None:
        baseline = hm.size("baseline_bytes")
        after = hm.size("after_load_bytes")
        assert baseline is not None and after is not None
        host = HostMemory(baseline_bytes=baseline, after_load_bytes=after, source=hm.source())
        hm.done()
    r.done()

    scenario = Scenario(
        name=name,
        description=" ".join(description.split()),
        gpu=gpu,
        model=model,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        topology_source=topology_source,
        defaults=defaults,
        logits=logits,
        components=components,
        load=load,
        host_memory=host,
        sources=dict(sources_doc),
        path=path,
    )
    _check_fits_at_rest(scenario, where)
    return scenario


def _check_fits_at_rest(s: Scenario, where: str) -> None:
    """A world where the model cannot even be loaded is a typo, not a scenario."""
    for rank in range(s.world_size):
        fixed = sum(s.phase_bytes(rank, p) for p in ("init", "weights", "cuda_graph", "serving"))
        if fixed >= s.gpu.total_bytes:
            raise ScenarioError(
                f"{where}: rank {rank} needs {gib(fixed):.2f} GiB before any KV cache, "
                f"more than the GPU's {gib(s.gpu.total_bytes):.2f} GiB"
            )


def builtin_dir() -> Path:
    return Path(str(resources.files("rankguard_sim").joinpath("scenarios")))


def builtin_names() -> list[str]:
    return sorted(p.stem for p in builtin_dir().glob("*.yaml"))


def load_scenario(name_or_path: str | os.PathLike[str]) -> Scenario:
    """A built-in scenario by name (e.g. "llama3-70b-tp4") or a YAML file by path."""
    text = os.fspath(name_or_path)
    path = Path(text)
    if not (path.suffix in (".yaml", ".yml") or os.sep in text or path.is_file()):
        path = builtin_dir() / f"{text}.yaml"
        if not path.is_file():
            raise ScenarioError(f"no built-in scenario {text!r}; built-ins: {', '.join(builtin_names())}")
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path.name}: not valid YAML ({e})") from None
    return parse_scenario(doc, where=path.name, path=str(path))


def find_scenario(model: str, tensor_parallel_size: int, pipeline_parallel_size: int) -> Scenario:
    """The one built-in scenario for this model and topology (when none was named)."""
    found = []
    for name in builtin_names():
        s = load_scenario(name)
        if (
            s.model.matches(model)
            and s.tensor_parallel_size == tensor_parallel_size
            and s.pipeline_parallel_size == pipeline_parallel_size
        ):
            found.append(s)
    if len(found) != 1:
        what = "no" if not found else "more than one"
        raise ScenarioError(
            f"{what} built-in scenario for {model} at TP{tensor_parallel_size}×PP{pipeline_parallel_size}; "
            f"set {SCENARIO_ENV} to one of: {', '.join(builtin_names())}"
        )
    return found[0]


# ---------------------------------------------------------------------------------------------
# Engine configuration (vLLM's flags, resolved against the scenario's defaults)


@dataclass(frozen=True)
class EngineConfig:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    dtype: str
    kv_cache_dtype: str
    enforce_eager: bool
    disable_custom_all_reduce: bool

    @property
    def dtype_bytes_override(self) -> int | None:
        return DTYPE_BYTES.get(self.dtype)


def engine_config(
    scenario: Scenario,
    *,
    tensor_parallel_size: int | None = None,
    pipeline_parallel_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_memory_bytes: int | None = None,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    enforce_eager: bool = False,
    disable_custom_all_reduce: bool = False,
    allow_long_max_model_len: bool = False,
) -> EngineConfig:
    """Fill vLLM's defaults for this scenario's GPU and check what vLLM checks at config time."""
    tp = scenario.tensor_parallel_size if tensor_parallel_size is None else tensor_parallel_size
    pp = scenario.pipeline_parallel_size if pipeline_parallel_size is None else pipeline_parallel_size
    if (tp, pp) != (scenario.tensor_parallel_size, scenario.pipeline_parallel_size):
        raise EngineConfigError(
            f"scenario {scenario.name} describes TP{scenario.tensor_parallel_size}×"
            f"PP{scenario.pipeline_parallel_size}; the simulated world has no measurements for TP{tp}×PP{pp}"
        )
    util = (
        scenario.defaults.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
    )
    if not 0.0 < util <= 1.0:
        raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 0:
        raise EngineConfigError(f"kv_cache_memory_bytes must be >= 0, got {kv_cache_memory_bytes}")
    seqs = scenario.defaults.max_num_seqs if max_num_seqs is None else max_num_seqs
    if seqs < 1:
        raise EngineConfigError(f"max_num_seqs must be >= 1, got {seqs}")
    tokens = (
        scenario.defaults.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    )
    if tokens < 1:
        raise EngineConfigError(f"max_num_batched_tokens must be >= 1, got {tokens}")
    derived_len = scenario.model.max_position_embeddings
    length = derived_len if max_model_len is None else max_model_len
    if length < 1:
        raise EngineConfigError(f"max_model_len must be >= 1, got {length}")
    if length > derived_len and not allow_long_max_model_len:
        # vLLM's wording (ModelConfig), shortened to its first two sentences.
        raise EngineConfigError(
            f"User-specified max_model_len ({length}) is greater than the derived max_model_len "
            f"(max_position_embeddings={derived_len} or model_max_length=None in model's config.json). "
            "To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
        )
    blocks = scenario.defaults.block_size if block_size is None else block_size
    if blocks not in BLOCK_SIZES:
        raise EngineConfigError(f"block_size must be one of {BLOCK_SIZES}, got {blocks}")
    if dtype not in DTYPES:
        raise EngineConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise EngineConfigError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    return EngineConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        gpu_memory_utilization=util,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        max_model_len=length,
        block_size=blocks,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=enforce_eager,
        disable_custom_all_reduce=disable_custom_all_reduce,
    )


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes under one engine configuration, by the phase that allocates them."""

    rank: int
    init: int  # CUDA context + communicators, before vLLM's memory snapshot
    weights: int
    profile_peak: int  # freed again after profile_run
    cuda_graph: int  # captured after the KV cache; vLLM subtracts its estimate of it
    serving: int  # communicator memory that first appears with real traffic
    logits_per_seq: int  # the transient that grows with the running batch
    kv_bytes_per_token: int
    block_bytes: int  # one KV block across this rank's layers

    def transient(self, running_seqs: int) -> int:
        return self.logits_per_seq * max(0, running_seqs)

    @property
    def holds_logits(self) -> bool:
        return self.logits_per_seq > 0


def _logits_per_seq(s: Scenario, rank: int) -> int:
    if not s.is_last_stage(rank):
        return 0  # earlier pipeline stages hand hidden states on; they never see logits
    vocab, tp, nbytes = s.model.vocab_size, s.tensor_parallel_size, s.logits.dtype_bytes
    if s.logits.mode == "all_gather" or tp == 1 or s.tp_rank(rank) == 0:
        return vocab * nbytes
    return math.ceil(vocab / tp) * nbytes  # the partial logits a non-driver rank computes


def rank_memory(scenario: Scenario, config: EngineConfig) -> list[RankMemory]:
    model_dtype = scenario.model.dtype_bytes
    dtype_bytes = config.dtype_bytes_override or model_dtype
    kv_dtype_bytes = KV_CACHE_DTYPE_BYTES.get(config.kv_cache_dtype, dtype_bytes)
    kv_heads = max(1, scenario.model.num_kv_heads // scenario.tensor_parallel_size)
    out = []
    for rank in range(scenario.world_size):
        phases = dict.fromkeys(PHASES, 0)
        for c in scenario.components:
            nbytes = c.bytes_for(rank)
            if c.disabled_by == "disable_custom_all_reduce" and config.disable_custom_all_reduce:
                continue
            if (c.disabled_by == "enforce_eager" or c.phase == "cuda_graph") and config.enforce_eager:
                continue
            if c.scales_with == "max_num_batched_tokens":
                nbytes = nbytes * config.max_num_batched_tokens // scenario.defaults.max_num_batched_tokens
            elif c.scales_with == "dtype":
                nbytes = nbytes * dtype_bytes // model_dtype
            phases[c.phase] += nbytes
        layers = scenario.layers_on_stage(scenario.pp_rank(rank))
        per_token = layers * 2 * kv_heads * scenario.model.head_dim * kv_dtype_bytes
        out.append(
            RankMemory(
                rank=rank,
                init=phases["init"],
                weights=phases["weights"],
                profile_peak=phases["profile"],
                cuda_graph=phases["cuda_graph"],
                serving=phases["serving"],
                logits_per_seq=_logits_per_seq(scenario, rank),
                kv_bytes_per_token=per_token,
                block_bytes=per_token * config.block_size,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Messages (formats of PyTorch and vLLM)


def format_size(nbytes: int) -> str:
    """PyTorch's c10 `format_size`: bytes up to 1 KiB, then KiB/MiB/GiB with two decimals."""
    if nbytes <= KIB:
        return f"{nbytes} bytes"
    if nbytes <= MIB:
        return f"{nbytes / KIB:.2f} KiB"
    if nbytes <= GIB:
        return f"{nbytes / MIB:.2f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def torch_allocation_size(nbytes: int) -> int:
    """The block size PyTorch's caching allocator asks the driver for (what "Tried to allocate" shows).

    Small requests come from 2 MiB segments, requests under 10 MiB from 20 MiB segments,
    and larger ones are rounded up to a multiple of 2 MiB.
    """
    if nbytes <= MIB:
        return 2 * MIB
    if nbytes < 10 * MIB:
        return 20 * MIB
    return 2 * MIB * math.ceil(nbytes / (2 * MIB))


def format_gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


class EngineFailure(Exception):
    """The engine stops; `rank` is the rank (local GPU index) that caused it, if one did."""

    reason = "EngineError"

    def __init__(self, rank: int | None, phase: str) -> None:
        super().__init__(rank, phase)
        self.rank = rank
        self.phase = phase

    @property
    def requested_bytes(self) -> int | None:
        return None

    @property
    def free_bytes(self) -> int | None:
        return None

    def message(self) -> str:
        return f"engine failed during {self.phase}"

    def __str__(self) -> str:
        return self.message()


class CudaOutOfMemory(EngineFailure):
    """A rank asked its GPU for more than was free: PyTorch's torch.OutOfMemoryError."""

    reason = CUDA_OOM

    def __init__(
        self,
        rank: int,
        phase: str,
        *,
        nbytes: int,
        free: int,
        total: int,
        process_bytes: int,
        torch_allocated: int,
        private_pools: int,
        others: Sequence[tuple[int, int]] = (),
        what: str = "",
    ) -> None:
        super().__init__(rank, phase)
        self.what = what  # the ledger tag being allocated (weights, kv_cache, logits, ...)
        self.nbytes = nbytes
        self.tried = torch_allocation_size(nbytes)
        self.free = free
        self.total = total
        self.process_bytes = process_bytes
        self.torch_allocated = torch_allocated
        self.private_pools = private_pools
        self.others = tuple(others)

    @property
    def requested_bytes(self) -> int | None:
        return self.tried

    @property
    def free_bytes(self) -> int | None:
        return self.free

    def message(self) -> str:
        others = "".join(f"Process {pid} has {format_size(n)} memory in use. " for pid, n in self.others)
        pools = (
            f"with {format_size(self.private_pools)} allocated in private pools (e.g., CUDA Graphs), "
            if self.private_pools
            else ""
        )
        return (
            f"CUDA out of memory. Tried to allocate {format_size(self.tried)}. "
            f"GPU {self.rank} has a total capacity of {format_size(self.total)} of which "
            f"{format_size(self.free)} is free. {others}Including non-PyTorch memory, this process has "
            f"{format_size(self.process_bytes)} memory in use. Of the allocated memory "
            f"{format_size(self.torch_allocated)} is allocated by PyTorch, {pools}and "
            f"{format_size(0)} is reserved by PyTorch but unallocated. If reserved but unallocated "
            "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
            "fragmentation.  See documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )


class SamplerWarmupOOM(CudaOutOfMemory):
    """vLLM wraps an OOM while pre-allocating the sampler's logits buffers in its own advice."""

    def __init__(self, oom: CudaOutOfMemory, num_reqs: int) -> None:
        super().__init__(
            oom.rank if oom.rank is not None else 0,
            "sampler-warmup",
            nbytes=oom.nbytes,
            free=oom.free,
            total=oom.total,
            process_bytes=oom.process_bytes,
            torch_allocated=oom.torch_allocated,
            private_pools=oom.private_pools,
            others=oom.others,
            what=oom.what,
        )
        self.num_reqs = num_reqs

    def advice(self) -> str:
        return (
            f"CUDA out of memory occurred when warming up sampler with {self.num_reqs} dummy requests. "
            "Please try lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine."
        )


class StartupFreeMemoryError(EngineFailure):
    """vLLM's check in init_device: free memory after NCCL init below total × utilisation."""

    reason = STARTUP_FREE_MEMORY

    def __init__(self, rank: int, *, free: int, total: int, utilization: float, requested: int) -> None:
        super().__init__(rank, "init-device")
        self.free = free
        self.total = total
        self.utilization = utilization
        self.requested = requested

    @property
    def requested_bytes(self) -> int | None:
        return self.requested

    @property
    def free_bytes(self) -> int | None:
        return self.free

    def message(self) -> str:
        return (
            f"Free memory on device cuda:{self.rank} ({format_gib(self.free)}/{format_gib(self.total)} GiB) "
            f"on startup is less than desired GPU memory utilization ({self.utilization}, "
            f"{format_gib(self.requested)} GiB). Decrease GPU memory utilization or reduce GPU memory "
            "used by other processes."
        )


class NoKVCacheMemory(EngineFailure):
    reason = NO_KV_MEMORY

    def __init__(self, rank: int, available: int) -> None:
        super().__init__(rank, "kv-cache")
        self.available = available

    @property
    def free_bytes(self) -> int | None:
        return max(0, self.available)

    def message(self) -> str:
        return (
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
            "when initializing the engine."
        )


class KVCacheTooSmall(EngineFailure):
    reason = KV_CACHE_TOO_SMALL

    def __init__(self, rank: int, *, max_model_len: int, needed: int, available: int, estimated: int) -> None:
        super().__init__(rank, "kv-cache")
        self.max_model_len = max_model_len
        self.needed = needed
        self.available = available
        self.estimated = estimated

    @property
    def requested_bytes(self) -> int | None:
        return self.needed

    @property
    def free_bytes(self) -> int | None:
        return self.available

    def message(self) -> str:
        return (
            f"To serve at least one request with the models's max seq len ({self.max_model_len}), "
            f"({format_gib(self.needed)} GiB KV cache is needed, which is larger than the available KV "
            f"cache memory ({format_gib(self.available)} GiB). Based on the available memory, the "
            f"estimated maximum model length is {self.estimated}. Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
        )


class GpuLost(EngineFailure):
    reason = GPU_LOST

    def message(self) -> str:
        return "CUDA error: unspecified launch failure (the GPU has fallen off the bus)"


# ---------------------------------------------------------------------------------------------
# vLLM v1's memory sequence over a ledger


class Ledger(Protocol):
    """What the engine can see of its GPUs: one process, rank i on the pod's i-th GPU."""

    def total(self, rank: int) -> int: ...

    def free(self, rank: int) -> int: ...

    def held(self, rank: int, tag: str) -> int: ...

    def hold(self, rank: int, tag: str, nbytes: int) -> None: ...

    def others(self, rank: int) -> list[tuple[int, int]]: ...

    def lost(self, rank: int) -> bool: ...


class PureLedger:
    """GPUs that exist only in memory (for `outcome()` and the tests)."""

    def __init__(self, totals: Sequence[int], others_used: Sequence[int] | None = None) -> None:
        self.totals = list(totals)
        self.others_used = list(others_used) if others_used is not None else [0] * len(self.totals)
        self.tags: list[dict[str, int]] = [{} for _ in self.totals]

    def total(self, rank: int) -> int:
        return self.totals[rank]

    def used(self, rank: int) -> int:
        return self.others_used[rank] + sum(self.tags[rank].values())

    def free(self, rank: int) -> int:
        return max(0, self.totals[rank] - self.used(rank))

    def held(self, rank: int, tag: str) -> int:
        return self.tags[rank].get(tag, 0)

    def hold(self, rank: int, tag: str, nbytes: int) -> None:
        if nbytes:
            self.tags[rank][tag] = nbytes
        else:
            self.tags[rank].pop(tag, None)

    def others(self, rank: int) -> list[tuple[int, int]]:
        return [(0, self.others_used[rank])] if self.others_used[rank] else []

    def lost(self, rank: int) -> bool:
        return False


# Tags: how the engine's memory splits for the OOM message (non-PyTorch vs PyTorch vs pools).
TAG_INIT = "init"
TAG_WEIGHTS = "weights"
TAG_PROFILE = "profile"
TAG_KV = "kv_cache"
TAG_GRAPHS = "cuda_graphs"
TAG_SERVING_COMM = "serving_comm"
TAG_TRANSIENT = "logits"
_TORCH_TAGS = (TAG_WEIGHTS, TAG_PROFILE, TAG_KV, TAG_TRANSIENT, TAG_GRAPHS)
ALL_TAGS = (TAG_INIT, *_TORCH_TAGS, TAG_SERVING_COMM)


@dataclass(frozen=True)
class KVPlan:
    available: tuple[int, ...]  # per rank, what each worker reports (vLLM's "Available KV cache memory")
    requested: tuple[int, ...]  # per rank, total × utilisation
    num_gpu_blocks: int  # the engine core's minimum over workers
    kv_bytes: tuple[int, ...]  # per rank, what is actually allocated
    block_size: int
    pinned: bool

    @property
    def num_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size


class EngineMemoryModel:
    """vLLM v1's start-up and serving memory sequence, one phase per method.

    Sources: vllm/v1/worker/gpu_worker.py (init_device takes the snapshot after NCCL init
    and refuses to start when free < total × utilisation; determine_available_memory;
    compile_or_warm_up_model captures CUDA graphs, then warms the sampler on the last
    pipeline stage), vllm/v1/core/kv_cache_utils.py (the engine core takes the minimum of
    the workers' block counts), and reference/vllm-memory-facts.md.
    """

    def __init__(self, scenario: Scenario, config: EngineConfig, ledger: Ledger) -> None:
        self.scenario = scenario
        self.config = config
        self.ledger = ledger
        self.ranks = rank_memory(scenario, config)
        self.plan: KVPlan | None = None
        self.snapshot_free: list[int] = []  # free memory per rank at vLLM's memory snapshot
        self.serving_started = False

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    # -- allocation ---------------------------------------------------------------------------

    def _allocate(self, rank: int, tag: str, nbytes: int, phase: str) -> None:
        if self.ledger.lost(rank):
            raise GpuLost(rank, phase)
        if nbytes <= 0:
            return
        free = self.ledger.free(rank)
        if nbytes > free:
            held = {t: self.ledger.held(rank, t) for t in ALL_TAGS}
            raise CudaOutOfMemory(
                rank,
                phase,
                nbytes=nbytes,
                free=free,
                total=self.ledger.total(rank),
                process_bytes=sum(held.values()),
                torch_allocated=sum(held[t] for t in _TORCH_TAGS),
                private_pools=held[TAG_GRAPHS],
                others=self.ledger.others(rank),
                what=tag,
            )
        self.ledger.hold(rank, tag, self.ledger.held(rank, tag) + nbytes)

    def _release(self, rank: int, tag: str) -> None:
        self.ledger.hold(rank, tag, 0)

    def release_all(self) -> None:
        for rank in range(self.world_size):
            for tag in ALL_TAGS:
                self._release(rank, tag)

    # -- start-up -----------------------------------------------------------------------------

    def init_devices(self) -> None:
        """CUDA context, NCCL communicators, custom all-reduce and NVLS buffers."""
        for m in self.ranks:
            self._allocate(m.rank, TAG_INIT, m.init, "init-device")

    def check_free_memory(self) -> list[int]:
        """requested = ceil(total × utilisation); vLLM refuses to start if free is below it.

        The check runs even when --kv-cache-memory-bytes is given (init_device always calls
        it), so a pinned budget also needs a utilisation the free memory can satisfy.
        """
        requested = []
        self.snapshot_free = [self.ledger.free(m.rank) for m in self.ranks]
        for m in self.ranks:
            total = self.ledger.total(m.rank)
            want = math.ceil(total * self.config.gpu_memory_utilization)
            free = self.snapshot_free[m.rank]
            if free < want:
                raise StartupFreeMemoryError(
                    m.rank,
                    free=free,
                    total=total,
                    utilization=self.config.gpu_memory_utilization,
                    requested=want,
                )
            requested.append(want)
        return requested

    def load_weights(self) -> None:
        for m in self.ranks:
            self._allocate(m.rank, TAG_WEIGHTS, m.weights, "load-model")

    def profile(self) -> None:
        """profile_run: a dummy forward at max_num_batched_tokens; its peak is freed again."""
        try:
            for m in self.ranks:
                self._allocate(m.rank, TAG_PROFILE, m.profile_peak, "profile-run")
        finally:
            for m in self.ranks:
                self._release(m.rank, TAG_PROFILE)

    def determine_kv(self, requested: Sequence[int]) -> KVPlan:
        cfg = self.config
        pinned = cfg.kv_cache_memory_bytes is not None
        available = []
        for m in self.ranks:
            if pinned:
                assert cfg.kv_cache_memory_bytes is not None
                avail = cfg.kv_cache_memory_bytes
            else:
                avail = requested[m.rank] - (m.weights + m.profile_peak + m.cuda_graph)
            if avail <= 0:
                raise NoKVCacheMemory(m.rank, avail)
            available.append(avail)
        blocks = [avail // m.block_bytes for avail, m in zip(available, self.ranks, strict=True)]
        per_request = math.ceil(cfg.max_model_len / cfg.block_size)
        for m, avail, nblocks in zip(self.ranks, available, blocks, strict=True):
            if nblocks < per_request:
                raise KVCacheTooSmall(
                    m.rank,
                    max_model_len=cfg.max_model_len,
                    needed=per_request * m.block_bytes,
                    available=avail,
                    estimated=nblocks * cfg.block_size,
                )
        num_blocks = min(blocks)
        self.plan = KVPlan(
            available=tuple(available),
            requested=tuple(requested),
            num_gpu_blocks=num_blocks,
            kv_bytes=tuple(num_blocks * m.block_bytes for m in self.ranks),
            block_size=cfg.block_size,
            pinned=pinned,
        )
        return self.plan

    def allocate_kv(self) -> None:
        assert self.plan is not None, "determine_kv first"
        for m, nbytes in zip(self.ranks, self.plan.kv_bytes, strict=True):
            self._allocate(m.rank, TAG_KV, nbytes, "initialize-kv-cache")

    def capture_cuda_graphs(self) -> None:
        for m in self.ranks:
            self._allocate(m.rank, TAG_GRAPHS, m.cuda_graph, "capture-cuda-graphs")

    def warm_up_sampler(self) -> None:
        """The last stage pre-allocates logits for max_num_seqs dummy requests, then frees them."""
        num_reqs = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        try:
            for m in self.ranks:
                self._allocate(m.rank, TAG_TRANSIENT, m.transient(num_reqs), "sampler-warmup")
        except CudaOutOfMemory as oom:
            raise SamplerWarmupOOM(oom, num_reqs) from oom
        finally:
            for m in self.ranks:
                self._release(m.rank, TAG_TRANSIENT)

    # -- serving ------------------------------------------------------------------------------

    def start_serving(self) -> None:
        """The first real forward: communicator memory that profiling never saw appears now."""
        if self.serving_started:
            return
        for m in self.ranks:
            self._allocate(m.rank, TAG_SERVING_COMM, m.serving, "execute-model")
        self.serving_started = True

    def begin_step(self, running_seqs: int) -> None:
        """One decode step's logits for `running_seqs` sequences (held until end_step)."""
        self.start_serving()
        for m in self.ranks:
            if self.ledger.lost(m.rank):
                raise GpuLost(m.rank, "execute-model")
            self._allocate(m.rank, TAG_TRANSIENT, m.transient(running_seqs), "execute-model")

    def end_step(self) -> None:
        for m in self.ranks:
            self._release(m.rank, TAG_TRANSIENT)

    def seq_capacity(self) -> int:
        """How many sequences of the load's length the KV cache can hold at once."""
        assert self.plan is not None
        per_seq = math.ceil(self.scenario.load.tokens_per_seq / self.config.block_size)
        return self.plan.num_gpu_blocks // per_seq

    def running_levels(self) -> list[int]:
        """The running batch at each ramp level: demand, capped by max_num_seqs and the KV cache."""
        cap = min(self.config.max_num_seqs, self.seq_capacity())
        return [min(d, cap) for d in self.scenario.load.demand_levels()]

    def startup(self) -> KVPlan:
        """Every start-up phase in vLLM's order (what `outcome()` replays without pauses)."""
        self.init_devices()
        requested = self.check_free_memory()
        self.load_weights()
        self.profile()
        plan = self.determine_kv(requested)
        self.allocate_kv()
        if not self.config.enforce_eager:
            self.capture_cuda_graphs()
        self.warm_up_sampler()
        return plan


# ---------------------------------------------------------------------------------------------
# Questions a benchmark asks


@dataclass(frozen=True)
class Outcome:
    crashes: bool
    rank: int | None  # the rank that failed (None when it does not crash)
    kv_bytes_per_rank: int  # KV cache allocated on the bottleneck view (min over ranks); 0 if none
    requested_bytes: int | None  # OOM: what PyTorch tried to allocate; start-up check: total × util
    free_bytes: int | None  # free on that GPU at that moment
    reason: str | None = None
    phase: str | None = None
    running_seqs: int | None = None  # the running batch when it crashed while serving
    num_gpu_blocks: int = 0
    kv_tokens: int = 0
    peak_running_seqs: int = 0  # the highest batch the load reached (capped by flags and KV)
    message: str | None = None


def outcome(
    scenario: Scenario,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float | None = None,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    block_size: int | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    enforce_eager: bool = False,
    disable_custom_all_reduce: bool = False,
    other_used_bytes: Sequence[int] | None = None,
) -> Outcome:
    """Replay start-up and one full load cycle on empty GPUs: does this flag set crash, where?

    The fake vLLM runs the same `EngineMemoryModel` phases over the GPU files, walking the
    same ramp levels, so this answer is the fake's behaviour. Raises EngineConfigError for
    flags vLLM would reject before touching a GPU.
    """
    config = engine_config(
        scenario,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=enforce_eager,
        disable_custom_all_reduce=disable_custom_all_reduce,
    )
    ledger = PureLedger([scenario.gpu.total_bytes] * scenario.world_size, other_used_bytes)
    engine = EngineMemoryModel(scenario, config, ledger)
    try:
        plan = engine.startup()
    except EngineFailure as failure:
        return _failed(failure, engine, None, 0)
    levels = engine.running_levels()
    peak = 0
    for running in levels:
        try:
            engine.begin_step(running)
        except EngineFailure as failure:
            return _failed(failure, engine, running, peak)
        peak = max(peak, running)
        engine.end_step()
    return Outcome(
        crashes=False,
        rank=None,
        kv_bytes_per_rank=min(plan.kv_bytes),
        requested_bytes=None,
        free_bytes=None,
        num_gpu_blocks=plan.num_gpu_blocks,
        kv_tokens=plan.num_tokens,
        peak_running_seqs=peak,
    )


def _failed(failure: EngineFailure, engine: EngineMemoryModel, running: int | None, peak: int) -> Outcome:
    plan = engine.plan
    return Outcome(
        crashes=True,
        rank=failure.rank,
        kv_bytes_per_rank=min(plan.kv_bytes) if plan is not None else 0,
        requested_bytes=failure.requested_bytes,
        free_bytes=failure.free_bytes,
        reason=failure.reason,
        phase=failure.phase,
        running_seqs=running,
        num_gpu_blocks=plan.num_gpu_blocks if plan is not None else 0,
        kv_tokens=plan.num_tokens if plan is not None else 0,
        peak_running_seqs=peak,
        message=failure.message(),
    )


@dataclass(frozen=True)
class SafeCapacity:
    """The world's own answer to "how much KV cache per rank can never crash?"."""

    kv_bytes: int  # min over ranks of the headroom left for KV at the scenario's peak load
    num_gpu_blocks: int  # the same in whole blocks (min over ranks)
    bottleneck_rank: int
    headroom_per_rank: tuple[int, ...]
    peak_running_seqs: int


def true_max_safe_kv(
    scenario: Scenario,
    *,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    block_size: int | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    enforce_eager: bool = False,
    disable_custom_all_reduce: bool = False,
) -> SafeCapacity:
    """min over ranks of total − every non-KV byte − the transient peak at the scenario's max load.

    Two moments bound each rank: serving at peak load (serving communicators + the logits of
    the peak batch) and the sampler warm-up at start-up (logits for max_num_seqs before the
    serving communicators exist). The peak batch is the load's peak capped by max_num_seqs;
    a smaller KV cache could cap it further, which only makes this bound conservative.
    """
    config = engine_config(
        scenario,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        enforce_eager=enforce_eager,
        disable_custom_all_reduce=disable_custom_all_reduce,
    )
    peak = min(scenario.load.peak_running_seqs, config.max_num_seqs)
    warmup = min(config.max_num_seqs, config.max_num_batched_tokens)
    headroom = []
    blocks = []
    for m in rank_memory(scenario, config):
        fixed = m.init + m.weights + m.cuda_graph
        worst = max(m.serving + m.transient(peak), m.transient(warmup))
        room = max(0, scenario.gpu.total_bytes - fixed - worst)
        headroom.append(room)
        blocks.append(room // m.block_bytes)
    bottleneck = min(range(len(headroom)), key=lambda r: (blocks[r], headroom[r]))
    return SafeCapacity(
        kv_bytes=min(headroom),
        num_gpu_blocks=min(blocks),
        bottleneck_rank=bottleneck,
        headroom_per_rank=tuple(headroom),
        peak_running_seqs=peak,
    )


def true_max_safe_kv_bytes(scenario: Scenario, **flags: Any) -> int:
    return true_max_safe_kv(scenario, **flags).kv_bytes


def describe(scenario: Scenario) -> Iterator[str]:
    """Human-readable lines: the scenario's per-rank truth at its defaults (docs, debugging)."""
    config = engine_config(scenario)
    topology = f"TP{scenario.tensor_parallel_size}×PP{scenario.pipeline_parallel_size}"
    yield f"{scenario.name}: {scenario.model.name} {topology}"
    yield f"  GPU {scenario.gpu.name}: {gib(scenario.gpu.total_bytes):.2f} GiB"
    for m in rank_memory(scenario, config):
        yield (
            f"  rank {m.rank}: init {gib(m.init):.2f} GiB, weights {gib(m.weights):.2f}, profile "
            f"{gib(m.profile_peak):.2f}, graphs {gib(m.cuda_graph):.2f}, serving comm {gib(m.serving):.2f}, "
            f"logits {m.logits_per_seq} B/seq, KV {m.kv_bytes_per_token} B/token"
        )
