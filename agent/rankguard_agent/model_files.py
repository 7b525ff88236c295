"""The served model's own files: where vLLM keeps them, and what config.json and the
safetensors headers say (so the operator can plan any model vLLM can load, offline).

`model_dir(argv, env)` finds the directory from the `vllm serve` command line and the
environment, as vLLM (through huggingface_hub) would: a local directory as given, else the
Hugging Face cache's `models--{org}--{name}/snapshots/<commit>`. `read_model_files(path)`
reads `config.json` and every `*.safetensors` file's header only (8 bytes of little-endian
length, then that much JSON; tensor data is never read) and sums it per tensor role
(`report_model`). Nothing here raises: a failure is `ModelFiles.error`.

Standard library only: this module runs inside the vLLM container.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankguard_agent.wire.report_model import (
    LAYER_ROLES,
    MAX_CONFIG_BYTES,
    MAX_COUNT,
    MAX_ERROR,
    MAX_FILES,
    MAX_LAYER_INDEX,
    MAX_LAYERS,
    MAX_PATH,
    ROLES,
    CheckpointSummary,
    LayerTally,
    ModelReport,
    ModelReportError,
    ParamTally,
    check_config,
    parse_model,
)

MAX_HEADER_BYTES = 32 * 1024 * 1024
MAX_INDEX_BYTES = 32 * 1024 * 1024  # model.safetensors.index.json (a 1 T-parameter model's is ~10 MiB)
FLOAT_SIZES = {"F32": 4, "F16": 2, "BF16": 2}
CONFIG = "config.json"
HF_QUANT_CONFIG = "hf_quant_config.json"
INDEX = "model.safetensors.index.json"

_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?$")


# -- where the model lives --------------------------------------------------------------------


def _flag(arg: str) -> tuple[str, str, str]:
    """(name, "=", value) of one argument; `--download_dir` and `--download-dir` alike."""
    name, eq, value = arg.partition("=")
    if name.startswith("--"):
        name = "--" + name[2:].replace("_", "-")
    return name, eq, value


def _options(argv: Sequence[str]) -> tuple[str | None, dict[str, str]]:
    """The positional model of `vllm serve MODEL` and the values of --model, --revision,
    --download-dir (the last one given wins, as argparse does)."""
    wanted = ("--model", "--revision", "--download-dir")
    found: dict[str, str] = {}
    positional: str | None = None
    args = list(argv)
    serve = next((i for i, a in enumerate(args) if a == "serve"), None)
    i = 0
    while i < len(args):
        name, eq, value = _flag(args[i])
        if name in wanted:
            if not eq:
                if i + 1 >= len(args):
                    break
                value = args[i + 1]
                i += 1
            found[name] = value
        elif serve is not None and i == serve + 1 and not args[i].startswith("-"):
            positional = args[i]
        i += 1
    return positional, found


def hf_hub_cache(env: Mapping[str, str]) -> Path:
    """huggingface_hub's cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
    return cache / "huggingface" / "hub"


def hf_snapshot(cache: Path, repo_id: str, revision: str | None = None) -> Path | None:
    """`cache/models--org--name/snapshots/<commit>`, the commit read from refs/<revision>."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    if _COMMIT.match(revision):
        commit = revision
    else:
        if ".." in revision.split("/"):
            return None
        try:
            with open(repo / "refs" / revision, encoding="utf-8") as f:
                commit = f.read(100).strip()
        except (OSError, UnicodeDecodeError):
            return None
        if not _COMMIT.match(commit):
            return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def model_name(argv: Sequence[str]) -> str | None:
    """The model the command line names (`vllm serve MODEL` or --model), if any."""
    positional, found = _options(argv)
    return positional or found.get("--model")


def model_dir(argv: Sequence[str], env: Mapping[str, str]) -> Path | None:
    """Where vLLM's model lives; None when it is not there (yet: vLLM may be downloading)."""
    positional, found = _options(argv)
    model = positional or found.get("--model")
    if not model:
        return None
    try:
        local = Path(model).expanduser()
        if local.is_dir():
            return local
        if model.startswith(("/", ".", "~")) or not _REPO_ID.match(model):
            return None  # a path that is not there (or a file, e.g. GGUF), not a repo id
        cache = Path(found["--download-dir"]).expanduser() if "--download-dir" in found else hf_hub_cache(env)
        return hf_snapshot(cache, model, found.get("--revision"))
    except (OSError, ValueError):
        return None


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFiles:
    """What `read_model_files` found. `complete`: every shard the index names is there (or,
    without an index, at least one safetensors file): the download has finished."""

    path: str
    config: dict[str, Any] | None = None
    config_bytes: int = 0
    checkpoint: CheckpointSummary | None = None
    error: str | None = None
    complete: bool = False
    tensors: int = 0

    def report(self) -> ModelReport:
        return ModelReport(self.path, self.config, self.config_bytes, self.checkpoint, self.error)


class _Unreadable(Exception):
    """A file cannot be used; the message is what ModelFiles.error says."""


def _read_json(path: Path, limit: int, what: str) -> tuple[Any, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as e:
        raise _Unreadable(f"{what}: {e.strerror or e}") from None
    if len(raw) > limit:
        raise _Unreadable(f"{what}: larger than {limit} bytes")
    return _loads(raw, what), len(raw)


def _loads(raw: bytes, what: str) -> Any:
    try:
        # NaN / Infinity are not JSON: read them as null rather than lose the document.
        return json.loads(raw.decode("utf-8"), parse_constant=lambda _: None)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _Unreadable(f"{what}: not UTF-8 JSON ({str(e)[:200]})") from None


def read_header(path: Path) -> dict[str, Any]:
    """One safetensors file's header (its JSON object); never reads tensor data."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _Unreadable(f"{path.name}: truncated (no header length)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise _Unreadable(f"{path.name}: header of {n} bytes, over {MAX_HEADER_BYTES}")
            raw = f.read(n)
    except OSError as e:
        raise _Unreadable(f"{path.name}: {e.strerror or e}") from None
    if len(raw) < n:
        raise _Unreadable(f"{path.name}: truncated header ({len(raw)} of {n} bytes)")
    header = _loads(raw, path.name)
    if not isinstance(header, dict):
        raise _Unreadable(f"{path.name}: the header is not a JSON object")
    return header


_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")
# Encoders beside the language model (and their projectors); their layers are not decoder layers.
_NON_TEXT = (
    "visual",
    "vision_tower",
    "vision_model",
    "multi_modal_projector",
    "mm_projector",
    "image_newline",
)
_EMBED = ("embed_tokens", "wte", "tok_embeddings", "word_embeddings")
_KV = ("k_proj", "v_proj", "k_scale", "v_scale")
_REPLICATED = ("gate", "router", "shared_expert_gate", "q_a_proj", "kv_a_proj_with_mqa")


def _is_non_text(part: str) -> bool:
    return part in _NON_TEXT or part.startswith(("vision_", "audio_"))


def tensor_role(name: str) -> tuple[str, int | None]:
    """(role, layer index): ("embed"|"head"|"vision"|"other", None) outside the decoder layers,
    ("split"|"kv"|"replicated", i) inside layer i of the language model."""
    parts = name.split(".")
    if any(_is_non_text(p) for p in parts):
        return "vision", None
    m = _LAYER.search(name)
    if m is None:
        if any(p in _EMBED for p in parts):
            return "embed", None
        if "lm_head" in parts or "embed_out" in parts or (len(parts) >= 2 and parts[-2] == "output"):
            return "head", None
        return "other", None
    index = int(m.group(1))
    inner = name[m.end() :].split(".")
    if any(p in _KV for p in inner):
        return "kv", index
    if any(p in _REPLICATED or "norm" in p or p.startswith("ln_") for p in inner):
        return "replicated", index
    return "split", index


def _numel(shape: Any, where: str) -> int:
    if not isinstance(shape, list) or len(shape) > 16:
        raise _Unreadable(f"{where}: bad shape")
    n = 1
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise _Unreadable(f"{where}: bad shape")
        n = min(n * d, MAX_COUNT + 1)
    return n


class _Sums:
    def __init__(self) -> None:
        self.by_dtype: dict[str, int] = {}
        self.roles = {r: [0, 0] for r in ROLES}
        self.layers: dict[int, dict[str, list[int]]] = {}
        self.total = 0
        self.tensors = 0

    def add(self, name: str, info: Any, where: str) -> None:
        if not isinstance(info, dict):
            raise _Unreadable(f"{where}: tensor {name[:100]!r} is not an object")
        dtype, offsets = info.get("dtype"), info.get("data_offsets")
        if not isinstance(dtype, str) or not 0 < len(dtype) <= 32:
            raise _Unreadable(f"{where}: tensor {name[:100]!r} has no dtype")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= MAX_COUNT
        ):
            raise _Unreadable(f"{where}: tensor {name[:100]!r} has bad data_offsets")
        nbytes = offsets[1] - offsets[0]
        numel = _numel(info.get("shape"), f"{where}: tensor {name[:100]!r}")
        size = FLOAT_SIZES.get(dtype)
        if size is not None and numel * size != nbytes:
            raise _Unreadable(f"{where}: tensor {name[:100]!r}: shape and data_offsets disagree")
        role, index = tensor_role(name)
        if index is None:
            tally = self.roles[role]
        else:
            if index > MAX_LAYER_INDEX:
                raise _Unreadable(f"{where}: tensor {name[:100]!r}: layer index over {MAX_LAYER_INDEX}")
            tally = self.layers.setdefault(index, {r: [0, 0] for r in LAYER_ROLES})[role]
        if size is not None:
            tally[0] += numel
        else:
            tally[1] += nbytes
        self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + nbytes
        self.total += nbytes
        self.tensors += 1

    def summary(self, files: int, index_total: int | None) -> CheckpointSummary:
        if len(self.layers) > MAX_LAYERS:
            raise _Unreadable(f"more than {MAX_LAYERS} layers")
        return CheckpointSummary(
            files=files,
            total_bytes=self.total,
            index_total_size=index_total,
            bytes_by_dtype=dict(sorted(self.by_dtype.items())),
            roles={r: ParamTally(*t) for r, t in self.roles.items()},
            layers=[
                LayerTally(i, *(ParamTally(*roles[r]) for r in LAYER_ROLES))
                for i, roles in sorted(self.layers.items())
            ],
        )


def _shards(path: Path) -> list[Path]:
    found: list[Path] = []
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.endswith(".safetensors"):
                    found.append(path / entry.name)
                    if len(found) > MAX_FILES:
                        raise _Unreadable(f"more than {MAX_FILES} .safetensors files")
    except OSError as e:
        raise _Unreadable(f"{path}: {e.strerror or e}") from None
    return sorted(found)


def _index(path: Path) -> tuple[int | None, set[str] | None]:
    """The index's metadata.total_size and the shard files its weight_map names."""
    if not (path / INDEX).is_file():
        return None, None
    doc, _ = _read_json(path / INDEX, MAX_INDEX_BYTES, INDEX)
    if not isinstance(doc, dict):
        raise _Unreadable(f"{INDEX}: not a JSON object")
    meta, weight_map = doc.get("metadata"), doc.get("weight_map")
    total = meta.get("total_size") if isinstance(meta, dict) else None
    if isinstance(total, float) and total.is_integer():
        total = int(total)
    if isinstance(total, bool) or not isinstance(total, int) or not 0 <= total <= MAX_COUNT:
        total = None
    shards = {v for v in weight_map.values() if isinstance(v, str)} if isinstance(weight_map, dict) else None
    return total, shards


def download_complete(path: Path) -> bool:
    """Cheap: config.json is there and so is every shard the index names (or, without an
    index, one safetensors file). The Hugging Face cache links a file into the snapshot only
    once it is whole."""
    try:
        if not (path / CONFIG).is_file():
            return False
        _, shards = _index(path)
        if shards is not None:
            return bool(shards) and all((path / s).is_file() for s in shards)
        return any(True for _ in _iter_safetensors(path))
    except (_Unreadable, OSError):
        return False


def _iter_safetensors(path: Path) -> Iterator[str]:
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name.endswith(".safetensors"):
                yield entry.name


def _read(path: Path) -> ModelFiles:
    config, config_bytes = _read_json(path / CONFIG, MAX_CONFIG_BYTES, CONFIG)
    try:
        config = check_config(config, CONFIG)
    except ModelReportError as e:
        raise _Unreadable(str(e)) from None
    if (path / HF_QUANT_CONFIG).is_file() and "quantization_config" not in config:
        # ModelOpt checkpoints keep their quantisation beside config.json; vLLM reads both, and
        # so does the operator's planner (under this key)
        quant, _ = _read_json(path / HF_QUANT_CONFIG, MAX_CONFIG_BYTES, HF_QUANT_CONFIG)
        if isinstance(quant, dict):
            config = {**config, "hf_quant_config": quant}
    index_total, shards = _index(path)
    files = _shards(path)
    checkpoint = None
    if files:
        sums = _Sums()
        for f in files:
            header = read_header(f)
            for name, info in header.items():
                if name != "__metadata__":
                    sums.add(name, info, f.name)
        checkpoint = sums.summary(len(files), index_total)
        tensors = sums.tensors
    else:
        tensors = 0
    names = {f.name for f in files}
    complete = bool(files) and (shards is None or (bool(shards) and shards <= names))
    return ModelFiles(str(path), config, config_bytes, checkpoint, None, complete, tensors)


def read_model_files(path: Path | str) -> ModelFiles:
    """config.json and the safetensors headers under `path`. Never raises."""
    where = str(path)[:MAX_PATH]
    try:
        found = _read(Path(path))
        if found.checkpoint is None:
            found = ModelFiles(where, found.config, found.config_bytes, error="no .safetensors files")
        parse_model(found.report().to_doc())  # what the operator will accept, checked here
        return found
    except _Unreadable as e:
        return ModelFiles(where, error=str(e)[:MAX_ERROR])
    except ModelReportError as e:
        return ModelFiles(where, error=str(e)[:MAX_ERROR])
    except Exception as e:  # a bug here must never take the agent (or the engine) down
        return ModelFiles(where, error=f"{type(e).__name__}: {e}"[:MAX_ERROR])


__all__ = [
    "ModelFiles",
    "download_complete",
    "hf_hub_cache",
    "hf_snapshot",
    "model_dir",
    "model_name",
    "read_header",
    "read_model_files",
    "tensor_role",
]
