"""Scenario files: reading and validating `scenarios/*.yaml` into a `Scenario`.

Validation is strict (unknown fields, missing sources, numbers out of range, a model that
cannot even be loaded on its GPU are all errors), because a typo in a scenario silently
changes the world every test and benchmark measures against.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from rankguard_sim.physics.checkpoint_tensors import (
    CheckpointConfigError,
    checkpoint_tensors,
    head_dim,
    text_config,
)
from rankguard_sim.physics.engine_config import DTYPE_BYTES
from rankguard_sim.physics.scenario_data import (
    DISABLED_BY,
    GIB,
    LOGITS_MODES,
    PHASES,
    SCALES_WITH,
    Component,
    DownloadSpec,
    EngineDefaults,
    GpuSpec,
    HostMemory,
    LoadPattern,
    LogitsSpec,
    ModelSpec,
    Scenario,
    ScenarioError,
    gib,
    parse_bytes,
)
from rankguard_sim.vllm_snapshot import SNAPSHOT_VERSION, scenario_block_size

SCENARIO_ENV = "RANKGUARD_SIM_SCENARIO"


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
    profiled = r._get("profiled", False)
    if profiled is not None and not isinstance(profiled, bool):
        raise ScenarioError(f"{where}.profiled: expected true or false")
    if profiled is not None and phase != "cuda_graph":
        raise ScenarioError(f"{where}.profiled: only a cuda_graph component has a profiler estimate")
    component = Component(
        name=name,
        phase=phase,
        default_bytes=default,
        rank_bytes=rank_bytes,
        source=r.source(),
        scales_with=r.choice("scales_with", SCALES_WITH),
        disabled_by=r.choice("disabled_by", DISABLED_BY),
        profiled=True if profiled is None else profiled,
    )
    if component.scales_with == "max_cudagraph_capture_size" and phase != "cuda_graph":
        raise ScenarioError(f"{where}.scales_with: only CUDA graphs grow with the capture sizes")
    if phase == "sampler" and component.scales_with is not None:
        raise ScenarioError(f"{where}.scales_with: a sampler component grows with the dummy requests already")
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
    # config.json's `architectures`: what vLLM's model registry reads (the fake's config checks)
    architectures = m._get("architectures", False) or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ScenarioError(f"{where}.model.architectures: expected a list of class names")
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
        architectures=tuple(architectures),
    )
    m.done()

    t = r.sub("topology")
    tp = t.integer("tensor_parallel_size", 1)
    pp = t.integer("pipeline_parallel_size", 1)
    nnodes = t.integer("nnodes", 1, default=1)
    topology_source = t.source()
    t.done()
    world = tp * pp
    if world % nnodes:
        raise ScenarioError(f"{where}.topology: {nnodes} nodes cannot split a world of {world} ranks evenly")
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
    if defaults.block_size != scenario_block_size():
        raise ScenarioError(
            f"{where}.engine_defaults.block_size: vLLM {SNAPSHOT_VERSION}'s default is "
            f"{scenario_block_size()} (its snapshot's engine.json), got {defaults.block_size}"
        )
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
    model_config = _model_config(r._get("model_config", False), f"{where}.model_config", path, model)
    dl = r.opt_sub("download")
    download = DownloadSpec()
    if dl is not None:
        rate = dl.size("bytes_per_second")
        assert rate is not None
        if rate <= 0:
            raise ScenarioError(f"{where}.download.bytes_per_second: must be > 0")
        download = DownloadSpec(bytes_per_second=rate, source=dl.source())
        dl.done()
    weights_do_not_fit = r._get("weights_do_not_fit", False)
    if weights_do_not_fit is not None and not isinstance(weights_do_not_fit, bool):
        raise ScenarioError(f"{where}.weights_do_not_fit: expected true or false")
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
        model_config=model_config,
        download=download,
        nnodes=nnodes,
        weights_do_not_fit=bool(weights_do_not_fit),
    )
    if scenario.weights_do_not_fit:
        _check_weights_do_not_fit(scenario, where)
    else:
        _check_fits_at_rest(scenario, where)
    return scenario


def _model_config(value: Any, where: str, path: str | None, model: ModelSpec) -> Mapping[str, Any] | None:
    """`model_config`: the config.json object, or a JSON file's path (relative: to the scenario's
    folder). It must describe the scenario's model, and its tensors must be derivable."""
    if value is None:
        return None
    if isinstance(value, str):
        file = Path(value)
        if not file.is_absolute():
            file = (Path(path).parent if path else Path.cwd()) / file
        try:
            value = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ScenarioError(f"{where}: cannot read {file} ({e})") from None
    if not isinstance(value, dict):
        raise ScenarioError(f"{where}: expected the config.json object or a JSON file's path")
    try:
        checkpoint_tensors(value)
        text = text_config(value)
        said = {
            "vocab_size": text["vocab_size"],
            "num_layers": text["num_hidden_layers"],
            "num_kv_heads": text.get("num_key_value_heads", text["num_attention_heads"]),
            "head_dim": head_dim(text),
        }
    except (CheckpointConfigError, KeyError) as e:
        raise ScenarioError(f"{where}: {e}") from None
    for key, figure in said.items():
        if figure != getattr(model, key):
            raise ScenarioError(f"{where}: {key} {figure} disagrees with model.{key} {getattr(model, key)}")
    return value


def _check_fits_at_rest(s: Scenario, where: str) -> None:
    """A world where the model cannot even be loaded is a typo, not a scenario."""
    for rank in range(s.world_size):
        fixed = sum(
            s.phase_bytes(rank, p) for p in ("other_process", "init", "weights", "cuda_graph", "serving")
        )
        if fixed >= s.gpu.total_bytes:
            raise ScenarioError(
                f"{where}: rank {rank} needs {gib(fixed):.2f} GiB before any KV cache, "
                f"more than the GPU's {gib(s.gpu.total_bytes):.2f} GiB"
            )


def _check_weights_do_not_fit(s: Scenario, where: str) -> None:
    """`weights_do_not_fit: true` must be true: on some rank the weights exceed what the CUDA
    context, the communicators and the other processes leave of the GPU."""
    for rank in range(s.world_size):
        held = sum(s.phase_bytes(rank, p) for p in ("other_process", "init", "weights"))
        if held > s.gpu.total_bytes:
            return
    raise ScenarioError(f"{where}: weights_do_not_fit is set, but every rank's weights fit its GPU")


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


def find_scenario(
    model: str, tensor_parallel_size: int, pipeline_parallel_size: int, nnodes: int = 1
) -> Scenario:
    """The one built-in scenario for this model and topology, its nodes included (when none was named)."""
    found = []
    for name in builtin_names():
        s = load_scenario(name)
        if (
            s.model.matches(model)
            and s.tensor_parallel_size == tensor_parallel_size
            and s.pipeline_parallel_size == pipeline_parallel_size
            and s.nnodes == nnodes
        ):
            found.append(s)
    if len(found) != 1:
        what = "no" if not found else "more than one"
        nodes = f" over {nnodes} nodes" if nnodes != 1 else ""
        raise ScenarioError(
            f"{what} built-in scenario for {model} at TP{tensor_parallel_size}×PP{pipeline_parallel_size}"
            f"{nodes}; set {SCENARIO_ENV} to one of: {', '.join(builtin_names())}"
        )
    return found[0]
