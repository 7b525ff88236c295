"""Model configs and safetensors files for the tests of the agent's model-file reader."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1}

# meta-llama/Meta-Llama-3-8B-Instruct's config.json (index total_size 16060522496).
LLAMA3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128009,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
LLAMA3_8B_PARAMS = 8_030_261_248


def numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_safetensors(path: Path, tensors: Mapping[str, tuple[str, list[int]]], *, data: bool = False) -> int:
    """A safetensors file: the header as the library writes it, then the tensors' bytes (zeros)
    when `data`, else nothing. Returns the bytes the tensors take."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = numel(shape) * DTYPE_SIZES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + (bytes(offset) if data else b""))
    return offset


def write_model(
    path: Path,
    shards: Sequence[Mapping[str, tuple[str, list[int]]]],
    config: Mapping[str, Any] | None = None,
    *,
    data: bool = False,
) -> int:
    """config.json, the shards and (more than one) the index. Returns the tensors' bytes."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config if config is not None else {"model_type": "t"}))
    if len(shards) == 1:
        return write_safetensors(path / "model.safetensors", shards[0], data=data)
    total, weight_map = 0, {}
    for k, tensors in enumerate(shards):
        name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(path / name, tensors, data=data)
        weight_map.update(dict.fromkeys(tensors, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


# A snapshot commit and another, for refs and revisions.
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def hf_repo(cache: Path, repo_id: str, refs: dict[str, str], snapshots: list[str]) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for ref, commit in refs.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    for commit in snapshots:
        (repo / "snapshots" / commit).mkdir(parents=True)
    return repo


def llama_tensors(layers: int, hidden: int = 64, kv: int = 16, inter: int = 128, vocab: int = 1000) -> Any:
    t: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [vocab, hidden])}
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = ("BF16", [hidden])
        t[f"{p}.self_attn.q_proj.weight"] = ("BF16", [hidden, hidden])
        t[f"{p}.self_attn.k_proj.weight"] = ("BF16", [kv, hidden])
        t[f"{p}.self_attn.v_proj.weight"] = ("BF16", [kv, hidden])
        t[f"{p}.self_attn.o_proj.weight"] = ("BF16", [hidden, hidden])
        t[f"{p}.post_attention_layernorm.weight"] = ("BF16", [hidden])
        t[f"{p}.mlp.gate_proj.weight"] = ("BF16", [inter, hidden])
        t[f"{p}.mlp.up_proj.weight"] = ("BF16", [inter, hidden])
        t[f"{p}.mlp.down_proj.weight"] = ("BF16", [hidden, inter])
    t["model.norm.weight"] = ("BF16", [hidden])
    t["lm_head.weight"] = ("BF16", [vocab, hidden])
    return t


def with_config(tmp_path: Path) -> Path:
    """A model directory with a config.json and one tiny safetensors file."""
    write_model(tmp_path, [{"model.norm.weight": ("BF16", [8])}])
    return tmp_path
