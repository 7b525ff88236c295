"""The `/report` document's advisory `model` field: what the served model's own files say.

The agent reads the model's `config.json` and the headers of its `*.safetensors` files
(`model_files`) and sends a summary; the operator plans from it without the network. On the
wire (camelCase, unlike the rest of the report, because it is a document of its own):

    "model": {
      "path": "/root/.cache/huggingface/hub/models--org--name/snapshots/<commit>",
      "config": {...config.json...} | null,
      "configBytes": 1234,                      # config.json's size on disk
      "checkpoint": {
        "files": 4, "totalBytes": 16060522496, "indexTotalSize": 16060522496 | null,
        "bytesByDtype": {"BF16": 16060522496},
        "roles": {"embed": [F, B], "head": [F, B], "vision": [F, B], "other": [F, B]},
        "layers": [[0, [F, B], [F, B], [F, B]], ...]    # index, split, kv, replicated
      } | null,
      "error": "why the files could not be read" | null
    }

where each `[F, B]` is a `ParamTally`: F = elements of floating-point tensors (F32/F16/BF16,
so the operator can rescale to the serving dtype), B = bytes of every other tensor (I8, U8,
I32, F8_*: quantised weights, their packed zeros and indices).

`parse_model` validates untrusted input and raises `ModelReportError` (report.py drops the
field alone and names it in `Report.dropped_fields`). Standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_COUNT = 1 << 50  # the largest believable element or byte count (as report.MAX_BYTES)
MAX_CONFIG_BYTES = 256 * 1024  # config.json, re-serialised compactly
MAX_CONFIG_DEPTH = 16
MAX_LAYERS = 4096
MAX_LAYER_INDEX = 1 << 20
MAX_FILES = 4096
MAX_DTYPES = 32
MAX_DTYPE_NAME = 32
MAX_PATH = 4096
MAX_ERROR = 1024
ROLES = ("embed", "head", "vision", "other")  # tensors outside the decoder layers
LAYER_ROLES = ("split", "kv", "replicated")  # tensors of one decoder layer


class ModelReportError(ValueError):
    """The `model` field is malformed. The message says where and why."""


@dataclass(frozen=True)
class ParamTally:
    """What one role holds: float elements (F32/F16/BF16) and the bytes of everything else."""

    float_params: int = 0
    other_bytes: int = 0

    def to_doc(self) -> list[int]:
        return [self.float_params, self.other_bytes]


@dataclass(frozen=True)
class LayerTally:
    """One decoder layer (MTP / draft layers are higher indices): what vLLM splits across
    the TP ranks, the K/V projections (replicated once TP exceeds the KV heads), and what
    every rank holds whole (norms, the MoE router, MLA's down-projections)."""

    index: int
    split: ParamTally = field(default_factory=ParamTally)
    kv: ParamTally = field(default_factory=ParamTally)
    replicated: ParamTally = field(default_factory=ParamTally)

    def to_doc(self) -> list[Any]:
        return [self.index, self.split.to_doc(), self.kv.to_doc(), self.replicated.to_doc()]


@dataclass(frozen=True)
class CheckpointSummary:
    """The safetensors headers, aggregated. `roles` keys are among ROLES."""

    files: int
    total_bytes: int  # sum of every tensor's bytes (data_offsets)
    index_total_size: int | None = None  # model.safetensors.index.json's metadata.total_size
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    roles: dict[str, ParamTally] = field(default_factory=dict)
    layers: list[LayerTally] = field(default_factory=list)  # ascending index

    def to_doc(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "totalBytes": self.total_bytes,
            "indexTotalSize": self.index_total_size,
            "bytesByDtype": dict(self.bytes_by_dtype),
            "roles": {k: v.to_doc() for k, v in self.roles.items()},
            "layers": [layer.to_doc() for layer in self.layers],
        }


@dataclass(frozen=True)
class ModelReport:
    """The served model's files as the agent read them (`Report.model`)."""

    path: str
    config: dict[str, Any] | None = None
    config_bytes: int = 0
    checkpoint: CheckpointSummary | None = None
    error: str | None = None

    def to_doc(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "config": self.config,
            "configBytes": self.config_bytes,
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_doc(),
            "error": self.error,
        }


# -- validation ------------------------------------------------------------------------------


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ModelReportError(f"{where}: expected an object, got {type(v).__name__}")
    return v


def _count(v: Any, where: str, hi: int = MAX_COUNT) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelReportError(f"{where}: expected an integer, got {v!r:.40}")
    if not 0 <= v <= hi:
        raise ModelReportError(f"{where}: {v} is outside [0, {hi}]")
    return v


def _text(v: Any, where: str, limit: int, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise ModelReportError(f"{where}: expected a string, got {v!r:.40}")
    if len(v) > limit:
        raise ModelReportError(f"{where}: longer than {limit} characters")
    return v


def _tally(v: Any, where: str) -> ParamTally:
    if not isinstance(v, list) or len(v) != 2:
        raise ModelReportError(f"{where}: expected [floatParams, otherBytes], got {v!r:.40}")
    return ParamTally(_count(v[0], f"{where}[0]"), _count(v[1], f"{where}[1]"))


def json_depth(v: Any) -> int:
    """Nesting depth of a JSON value: a scalar is 0, {} and [] are 1. Iterative (no recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(v, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((x, depth + 1) for x in item.values())
            deepest = max(deepest, depth + 1)
        elif isinstance(item, list):
            stack.extend((x, depth + 1) for x in item)
            deepest = max(deepest, depth + 1)
        if deepest > MAX_CONFIG_DEPTH:
            break  # no need to walk the rest of a hostile document
    return deepest


def check_config(v: Any, where: str = "config") -> dict[str, Any]:
    """A config.json object within bounds: depth, re-serialised size, finite numbers only."""
    d = _obj(v, where)
    if json_depth(d) > MAX_CONFIG_DEPTH:
        raise ModelReportError(f"{where}: nested deeper than {MAX_CONFIG_DEPTH}")
    try:
        text = json.dumps(d, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ModelReportError(f"{where}: not plain JSON with finite numbers ({e})") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ModelReportError(f"{where}: {len(text)} bytes re-serialised, over {MAX_CONFIG_BYTES}")
    return d


def _checkpoint(v: Any, where: str) -> CheckpointSummary | None:
    if v is None:
        return None
    d = _obj(v, where)
    by_dtype = _obj(d.get("bytesByDtype", {}), f"{where}.bytesByDtype")
    if len(by_dtype) > MAX_DTYPES:
        raise ModelReportError(f"{where}.bytesByDtype: more than {MAX_DTYPES} dtypes")
    for name in by_dtype:
        if not 0 < len(name) <= MAX_DTYPE_NAME:
            raise ModelReportError(f"{where}.bytesByDtype: dtype name {name!r:.40} not 1..{MAX_DTYPE_NAME}")
    roles_doc = _obj(d.get("roles", {}), f"{where}.roles")
    unknown = sorted(set(roles_doc) - set(ROLES))
    if unknown:
        raise ModelReportError(f"{where}.roles: unknown role(s) {', '.join(unknown)[:80]}")
    layers_doc = d.get("layers", [])
    if not isinstance(layers_doc, list) or len(layers_doc) > MAX_LAYERS:
        raise ModelReportError(f"{where}.layers: expected a list of at most {MAX_LAYERS} layers")
    layers: list[LayerTally] = []
    for i, entry in enumerate(layers_doc):
        w = f"{where}.layers[{i}]"
        if not isinstance(entry, list) or len(entry) != 1 + len(LAYER_ROLES):
            raise ModelReportError(f"{w}: expected [index, split, kv, replicated]")
        index = _count(entry[0], f"{w}[0]", MAX_LAYER_INDEX)
        if layers and index <= layers[-1].index:
            raise ModelReportError(f"{w}: layer indices must ascend, each once")
        layers.append(LayerTally(index, *(_tally(t, f"{w}[{j + 1}]") for j, t in enumerate(entry[1:]))))
    index_total = d.get("indexTotalSize")
    return CheckpointSummary(
        files=_count(d.get("files"), f"{where}.files", MAX_FILES),
        total_bytes=_count(d.get("totalBytes"), f"{where}.totalBytes"),
        index_total_size=None if index_total is None else _count(index_total, f"{where}.indexTotalSize"),
        bytes_by_dtype={k: _count(n, f"{where}.bytesByDtype.{k}") for k, n in by_dtype.items()},
        roles={k: _tally(t, f"{where}.roles.{k}") for k, t in roles_doc.items()},
        layers=layers,
    )


def parse_model(v: Any, where: str = "report.model") -> ModelReport | None:
    """Validate the untrusted `model` field (None when absent). Raises ModelReportError."""
    if v is None:
        return None
    d = _obj(v, where)
    config = d.get("config")
    return ModelReport(
        path=_text(d.get("path"), f"{where}.path", MAX_PATH) or "",
        config=None if config is None else check_config(config, f"{where}.config"),
        config_bytes=_count(d.get("configBytes", 0), f"{where}.configBytes"),
        checkpoint=_checkpoint(d.get("checkpoint"), f"{where}.checkpoint"),
        error=_text(d.get("error"), f"{where}.error", MAX_ERROR, optional=True),
    )
