"""The fake vLLM's "download": a model in the Hugging Face cache, header-only.

Laid out as huggingface_hub lays it out, so anything that resolves a repo id in the cache
(the agent's `model_files`) finds it:

    $HF_HUB_CACHE | $HF_HOME/hub | ~/.cache/huggingface/hub     (or vLLM's --download-dir)
      models--{org}--{name}/
        refs/main                                   the commit, 40 hex digits
        blobs/<sha256>                              the files' content
        snapshots/<commit>/config.json -> ../../blobs/<sha256>
        snapshots/<commit>/model-0000k-of-0000n.safetensors -> ...
        snapshots/<commit>/model.safetensors.index.json -> ...  (more than one shard)

The safetensors files hold a valid header (dtype, shape, data_offsets of every tensor,
padded to 8 bytes as the safetensors library writes it) and NO tensor data: the sandbox's
checkpoints cost kilobytes, and a reader that reads only headers does not notice. Files
appear in download order (config first, the index, then the shards), each linked into the
snapshot only once its blob is whole, as huggingface_hub does. `checkpoint()` also says how
big each file really is (`CheckpointFile.nbytes`: header plus tensor data), which is what
the fake vLLM's download costs in time (fake_vllm.FakeVllm.download_weights).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankguard_sim.physics.checkpoint_tensors import TensorSpec, checkpoint_tensors

MAX_SHARD_BYTES = 5 * 1000**3  # huggingface's save_pretrained default, max_shard_size="5GB"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?$")


def hf_hub_cache(env: Mapping[str, str]) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    return Path(env.get("HOME") or Path.home()) / ".cache" / "huggingface" / "hub"


def is_repo_id(model: str) -> bool:
    return bool(_REPO_ID.match(model)) and not Path(model).exists()


def fake_commit(repo_id: str, config: Mapping[str, Any]) -> str:
    text = json.dumps({"repo": repo_id, "config": config}, sort_keys=True)
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def safetensors_header(tensors: Sequence[TensorSpec]) -> bytes:
    """The 8-byte length and the JSON header of a file holding `tensors`, in order."""
    doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        doc[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def shard(tensors: Sequence[TensorSpec], max_bytes: int = MAX_SHARD_BYTES) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


@dataclass(frozen=True)
class CheckpointFile:
    """One file of a checkpoint as the sandbox writes it, and as big as the real one is."""

    name: str
    data: bytes  # what the sandbox writes (a safetensors file: its header only)
    nbytes: int  # the real file's size (a safetensors file: header and tensor data)
    weights: bool  # a weights file: what vLLM's download_weights_from_hf fetches (timed)


def checkpoint(config: Mapping[str, Any], max_shard_bytes: int = MAX_SHARD_BYTES) -> list[CheckpointFile]:
    """The checkpoint's files in download order: config.json, the index, the shards."""
    tensors = checkpoint_tensors(config)
    shards = shard(tensors, max_shard_bytes)
    config_data = json.dumps(config, indent=2).encode()
    files = [CheckpointFile("config.json", config_data, len(config_data), weights=False)]

    def weights(name: str, part: Sequence[TensorSpec]) -> CheckpointFile:
        header = safetensors_header(part)
        return CheckpointFile(name, header, len(header) + sum(t.nbytes for t in part), weights=True)

    if len(shards) == 1:
        return [*files, weights("model.safetensors", shards[0])]
    names = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    index = {
        "metadata": {"total_size": sum(t.nbytes for t in tensors)},
        "weight_map": {t.name: name for name, part in zip(names, shards, strict=True) for t in part},
    }
    index_data = json.dumps(index, indent=2).encode()
    files.append(CheckpointFile("model.safetensors.index.json", index_data, len(index_data), weights=False))
    return [*files, *(weights(name, part) for name, part in zip(names, shards, strict=True))]


def checkpoint_files(config: Mapping[str, Any], max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, bytes]:
    """File name -> content, in download order: config.json, the index, the shards."""
    return {f.name: f.data for f in checkpoint(config, max_shard_bytes)}


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.incomplete")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class CachedRepo:
    """Where one repo id's revision lives in a Hugging Face cache."""

    cache: Path
    repo_id: str
    commit: str

    @property
    def folder(self) -> Path:
        return self.cache / ("models--" + self.repo_id.replace("/", "--"))

    @property
    def snapshot(self) -> Path:
        return self.folder / "snapshots" / self.commit

    def has(self, name: str) -> bool:
        """The file is whole in the cache (linked into the snapshot only once it is)."""
        return (self.snapshot / name).exists()

    def lock_path(self, f: CheckpointFile) -> Path:
        """huggingface_hub's per-blob lock file (`<cache>/.locks/<repo folder>/<blob>.lock`)."""
        return self.cache / ".locks" / self.folder.name / f"{hashlib.sha256(f.data).hexdigest()}.lock"

    def store(self, f: CheckpointFile) -> None:
        """The blob, then its link in the snapshot, as huggingface_hub does (idempotent)."""
        link = self.snapshot / f.name
        if link.exists():
            return
        blob = hashlib.sha256(f.data).hexdigest()
        _atomic_write(self.folder / "blobs" / blob, f.data)
        tmp = link.with_name(f".{f.name}.{os.getpid()}.link")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        tmp.symlink_to(Path("..") / ".." / "blobs" / blob)
        os.replace(tmp, link)


def prepare(cache: Path, repo_id: str, config: Mapping[str, Any], revision: str | None = None) -> CachedRepo:
    """The repo's folders and `refs/<revision>` (a pinned 40-hex revision is the commit itself)."""
    pinned = revision is not None and re.fullmatch(r"[0-9a-f]{40}", revision) is not None
    commit = revision if pinned and revision else fake_commit(repo_id, config)
    repo = CachedRepo(cache, repo_id, commit)
    for d in (repo.folder / "refs", repo.folder / "blobs", repo.snapshot):
        d.mkdir(parents=True, exist_ok=True)
    if not pinned:
        ref = repo.folder / "refs" / (revision or "main")
        ref.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(ref, commit.encode())
    return repo


def download(cache: Path, repo_id: str, config: Mapping[str, Any], revision: str | None = None) -> Path:
    """Put the model into the cache at once (idempotent) and return its snapshot directory."""
    repo = prepare(cache, repo_id, config, revision)
    for f in checkpoint(config):
        repo.store(f)
    return repo.snapshot
