"""The agent's reader of the served model's files (`model_files.read_model_files`): what the
safetensors headers say per tensor role, quantised layouts, and the bounds on everything read."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from rankguard_agent.model_files import (
    read_model_files,
    tensor_role,
)
from rankguard_agent.wire.report_model import LayerTally, ParamTally
from tests.unit.model_checkpoints import llama_tensors, with_config, write_model

# -- where the model lives ----------------------------------------------------------------------


# -- roles ------------------------------------------------------------------------------------

ROLE_CASES: dict[str, list[tuple[str, str, int | None]]] = {
    "llama": [
        ("model.embed_tokens.weight", "embed", None),
        ("model.layers.0.self_attn.q_proj.weight", "split", 0),
        ("model.layers.0.self_attn.k_proj.weight", "kv", 0),
        ("model.layers.0.self_attn.v_proj.weight", "kv", 0),
        ("model.layers.0.self_attn.o_proj.weight", "split", 0),
        ("model.layers.31.mlp.gate_proj.weight", "split", 31),
        ("model.layers.31.mlp.up_proj.weight", "split", 31),
        ("model.layers.31.mlp.down_proj.weight", "split", 31),
        ("model.layers.31.input_layernorm.weight", "replicated", 31),
        ("model.layers.31.post_attention_layernorm.weight", "replicated", 31),
        ("model.norm.weight", "other", None),
        ("lm_head.weight", "head", None),
    ],
    "qwen2-moe": [
        ("model.layers.0.self_attn.k_proj.bias", "kv", 0),
        ("model.layers.0.self_attn.q_proj.bias", "split", 0),
        ("model.layers.0.mlp.gate.weight", "replicated", 0),
        ("model.layers.0.mlp.experts.59.gate_proj.weight", "split", 0),
        ("model.layers.0.mlp.experts.59.down_proj.weight", "split", 0),
        ("model.layers.0.mlp.shared_expert.gate_proj.weight", "split", 0),
        ("model.layers.0.mlp.shared_expert_gate.weight", "replicated", 0),
        ("model.layers.23.mlp.gate_up_proj.weight", "split", 23),
    ],
    "deepseek-v3": [
        ("model.layers.0.self_attn.q_a_proj.weight", "replicated", 0),
        ("model.layers.0.self_attn.q_a_proj.weight_scale_inv", "replicated", 0),
        ("model.layers.0.self_attn.q_a_layernorm.weight", "replicated", 0),
        ("model.layers.0.self_attn.q_b_proj.weight", "split", 0),
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "replicated", 0),
        ("model.layers.0.self_attn.kv_a_layernorm.weight", "replicated", 0),
        ("model.layers.0.self_attn.kv_b_proj.weight", "split", 0),
        ("model.layers.0.self_attn.o_proj.weight_scale_inv", "split", 0),
        ("model.layers.0.mlp.gate_proj.weight", "split", 0),
        ("model.layers.3.mlp.gate.weight", "replicated", 3),
        ("model.layers.3.mlp.gate.e_score_correction_bias", "replicated", 3),
        ("model.layers.3.mlp.experts.255.down_proj.weight", "split", 3),
        ("model.layers.3.mlp.shared_experts.up_proj.weight", "split", 3),
        ("model.layers.61.embed_tokens.weight", "split", 61),  # MTP: a higher index, nothing else
        ("model.layers.61.enorm.weight", "replicated", 61),
        ("model.layers.61.hnorm.weight", "replicated", 61),
        ("model.layers.61.eh_proj.weight", "split", 61),
        ("model.layers.61.shared_head.norm.weight", "replicated", 61),
        ("model.layers.61.shared_head.head.weight", "split", 61),
        ("model.layers.61.mlp.gate.weight", "replicated", 61),
    ],
    "gemma-3": [
        ("language_model.model.embed_tokens.weight", "embed", None),
        ("language_model.model.layers.5.self_attn.k_norm.weight", "replicated", 5),
        ("language_model.model.layers.5.self_attn.k_proj.weight", "kv", 5),
        ("language_model.model.layers.5.pre_feedforward_layernorm.weight", "replicated", 5),
        ("language_model.model.norm.weight", "other", None),
        ("multi_modal_projector.mm_input_projection_weight", "vision", None),
        ("multi_modal_projector.mm_soft_emb_norm.weight", "vision", None),
        ("vision_tower.vision_model.encoder.layers.0.self_attn.k_proj.weight", "vision", None),
        ("vision_tower.vision_model.post_layernorm.weight", "vision", None),
        ("model.language_model.layers.5.mlp.gate_proj.weight", "split", 5),  # transformers >= 4.52
        ("model.vision_tower.vision_model.embeddings.patch_embedding.weight", "vision", None),
    ],
    "qwen2.5-vl": [
        ("visual.patch_embed.proj.weight", "vision", None),
        ("visual.blocks.31.attn.qkv.weight", "vision", None),
        ("visual.merger.mlp.0.weight", "vision", None),
        ("model.layers.27.self_attn.v_proj.bias", "kv", 27),
        ("model.visual.blocks.0.norm1.weight", "vision", None),
        ("lm_head.weight", "head", None),
    ],
    "llava": [
        ("image_newline", "vision", None),
        ("model.mm_projector.0.weight", "vision", None),
        ("language_model.lm_head.weight", "head", None),
    ],
    "awq-gptq": [
        ("model.layers.0.self_attn.k_proj.qweight", "kv", 0),
        ("model.layers.0.self_attn.k_proj.qzeros", "kv", 0),
        ("model.layers.0.self_attn.k_proj.scales", "kv", 0),
        ("model.layers.0.self_attn.v_proj.g_idx", "kv", 0),
        ("model.layers.0.mlp.down_proj.qweight", "split", 0),
    ],
    "fp8": [
        ("model.layers.0.self_attn.k_proj.weight_scale", "kv", 0),
        ("model.layers.0.self_attn.k_proj.input_scale", "kv", 0),
        ("model.layers.0.self_attn.k_scale", "kv", 0),
        ("model.layers.0.mlp.gate_up_proj.weight", "split", 0),
    ],
    "gpt2-and-meta": [
        ("transformer.wte.weight", "embed", None),
        ("transformer.wpe.weight", "other", None),
        ("transformer.h.11.ln_1.weight", "replicated", 11),
        ("transformer.h.11.attn.c_attn.weight", "split", 11),
        ("transformer.ln_f.weight", "other", None),
        ("tok_embeddings.weight", "embed", None),
        ("output.weight", "head", None),
        ("gpt_neox.embed_in.weight", "other", None),
        ("embed_out.weight", "head", None),
        ("transformer.word_embeddings.weight", "embed", None),
    ],
}


@pytest.mark.parametrize(
    ("name", "role", "index"), [c for cases in ROLE_CASES.values() for c in cases], ids=str
)
def test_tensor_roles_on_real_names(name: str, role: str, index: int | None) -> None:
    assert tensor_role(name) == (role, index)


# -- reading ----------------------------------------------------------------------------------


def test_a_sharded_checkpoint_with_data_is_summed_per_role(tmp_path: Path) -> None:
    tensors = llama_tensors(2)
    names = list(tensors)
    shards = [{n: tensors[n] for n in names[:9]}, {n: tensors[n] for n in names[9:]}]
    config = {"model_type": "llama", "hidden_size": 64, "rope_theta": float("nan")}  # json writes NaN
    total = write_model(tmp_path / "m", shards, config, data=True)
    found = read_model_files(tmp_path / "m")
    assert found.error is None and found.complete and found.tensors == len(tensors)
    assert found.config == {"model_type": "llama", "hidden_size": 64, "rope_theta": None}
    assert found.config_bytes == len(json.dumps(config))
    ck = found.checkpoint
    assert ck is not None
    assert (ck.files, ck.total_bytes, ck.index_total_size) == (2, total, total)
    assert ck.bytes_by_dtype == {"BF16": total}
    assert ck.roles == {
        "embed": ParamTally(64_000, 0),
        "head": ParamTally(64_000, 0),
        "vision": ParamTally(0, 0),
        "other": ParamTally(64, 0),
    }
    layer = LayerTally(
        0,
        split=ParamTally(2 * 64 * 64 + 3 * 128 * 64, 0),
        kv=ParamTally(2 * 16 * 64, 0),
        replicated=ParamTally(128, 0),
    )
    assert ck.layers == [layer, LayerTally(1, layer.split, layer.kv, layer.replicated)]


def test_a_quantised_awq_checkpoint_counts_packed_weights_as_bytes(tmp_path: Path) -> None:
    p = "model.layers.0"
    tensors = {
        "model.embed_tokens.weight": ("F16", [1000, 64]),
        f"{p}.self_attn.k_proj.qweight": ("I32", [64, 2]),
        f"{p}.self_attn.k_proj.qzeros": ("I32", [1, 2]),
        f"{p}.self_attn.k_proj.scales": ("F16", [1, 16]),
        f"{p}.self_attn.q_proj.qweight": ("I32", [64, 8]),
        f"{p}.self_attn.q_proj.g_idx": ("I32", [64]),
        f"{p}.input_layernorm.weight": ("F16", [64]),
    }
    write_model(tmp_path, [tensors])
    ck = read_model_files(tmp_path).checkpoint
    assert ck is not None and ck.index_total_size is None and ck.files == 1
    assert ck.layers == [
        LayerTally(
            0,
            split=ParamTally(0, 64 * 8 * 4 + 64 * 4),
            kv=ParamTally(16, (128 + 2) * 4),
            replicated=ParamTally(64, 0),
        )
    ]
    assert ck.bytes_by_dtype == {"F16": (64_000 + 16 + 64) * 2, "I32": (128 + 2 + 512 + 64) * 4}


def test_an_fp8_checkpoint_counts_fp8_bytes_and_f32_scales(tmp_path: Path) -> None:
    p = "model.layers.0"
    tensors = {
        f"{p}.self_attn.k_proj.weight": ("F8_E4M3", [16, 64]),
        f"{p}.self_attn.k_proj.weight_scale": ("F32", []),
        f"{p}.self_attn.k_proj.input_scale": ("F32", []),
        f"{p}.mlp.down_proj.weight": ("F8_E4M3", [64, 128]),
        f"{p}.mlp.down_proj.weight_scale": ("F32", [64, 1]),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight": ("F8_E4M3", [32, 64]),
        f"{p}.self_attn.kv_a_proj_with_mqa.weight_scale_inv": ("F32", [1, 1]),
    }
    write_model(tmp_path, [tensors], data=True)
    ck = read_model_files(tmp_path).checkpoint
    assert ck is not None
    assert ck.layers == [
        LayerTally(
            0, split=ParamTally(64, 64 * 128), kv=ParamTally(2, 16 * 64), replicated=ParamTally(1, 32 * 64)
        )
    ]
    assert ck.bytes_by_dtype == {"F8_E4M3": 16 * 64 + 64 * 128 + 32 * 64, "F32": (2 + 64 + 1) * 4}


def test_the_headers_of_a_deepseek_like_checkpoint_need_no_data(tmp_path: Path) -> None:
    tensors = {
        "model.embed_tokens.weight": ("BF16", [129280, 7168]),
        "model.layers.0.self_attn.q_a_proj.weight": ("F8_E4M3", [1536, 7168]),
        "model.layers.0.self_attn.q_a_proj.weight_scale_inv": ("F32", [12, 56]),
        "model.layers.3.mlp.gate.weight": ("BF16", [256, 7168]),
        "model.layers.3.mlp.gate.e_score_correction_bias": ("F32", [256]),
        "model.layers.61.shared_head.head.weight": ("BF16", [129280, 7168]),
        "model.layers.61.enorm.weight": ("BF16", [7168]),
        "lm_head.weight": ("BF16", [129280, 7168]),
    }
    write_model(tmp_path, [tensors])  # header-only: tensor data is never read
    ck = read_model_files(tmp_path).checkpoint
    assert ck is not None
    assert [(layer.index, layer.replicated) for layer in ck.layers] == [
        (0, ParamTally(12 * 56, 1536 * 7168)),
        (3, ParamTally(256 * 7168 + 256, 0)),
        (61, ParamTally(7168, 0)),
    ]
    assert ck.layers[2].split == ParamTally(129280 * 7168, 0)


def test_a_vision_tower_is_its_own_role(tmp_path: Path) -> None:
    tensors = {
        "visual.blocks.0.attn.qkv.weight": ("BF16", [3 * 1280, 1280]),
        "visual.merger.mlp.0.weight": ("BF16", [5120, 5120]),
        "model.layers.0.self_attn.k_proj.weight": ("BF16", [512, 3584]),
    }
    write_model(tmp_path, [tensors])
    ck = read_model_files(tmp_path).checkpoint
    assert ck is not None
    assert ck.roles["vision"] == ParamTally(3 * 1280 * 1280 + 5120 * 5120, 0)
    assert [layer.index for layer in ck.layers] == [0]


# -- bounds: every failure is an error text, never an exception ----------------------------------


def _raw(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (struct.pack("<Q", 64 << 20) + b"{}", "header of 67108864 bytes, over"),
        (struct.pack("<Q", 1000) + b'{"a":', "truncated header (5 of 1000 bytes)"),
        (b"\x01\x02", "truncated (no header length)"),
        (struct.pack("<Q", 4) + b"[1] ", "not a JSON object"),
        (struct.pack("<Q", 4) + b"{{{{", "not UTF-8 JSON"),
        (struct.pack("<Q", 2) + b"\xff\xfe", "not UTF-8 JSON"),
    ],
)
def test_a_broken_safetensors_file_is_an_error(tmp_path: Path, data: bytes, why: str) -> None:
    _raw(with_config(tmp_path) / "model.safetensors", data)
    found = read_model_files(tmp_path)
    assert found.error is not None and why in found.error and "model.safetensors" in found.error
    assert found.checkpoint is None and found.config is None


@pytest.mark.parametrize(
    ("info", "why"),
    [
        ({"dtype": "BF16", "shape": [4], "data_offsets": [0, 7]}, "shape and data_offsets disagree"),
        ({"dtype": "BF16", "shape": [-4], "data_offsets": [0, 8]}, "bad shape"),
        ({"dtype": "BF16", "shape": [4], "data_offsets": [8, 0]}, "bad data_offsets"),
        ({"shape": [4], "data_offsets": [0, 8]}, "no dtype"),
        ([1, 2], "is not an object"),
    ],
)
def test_a_bad_tensor_entry_is_an_error(tmp_path: Path, info: Any, why: str) -> None:
    raw = json.dumps({"model.norm.weight": info}).encode()
    _raw(with_config(tmp_path) / "model.safetensors", struct.pack("<Q", len(raw)) + raw)
    found = read_model_files(tmp_path)
    assert found.error is not None and why in found.error


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (b"[1, 2]", "expected an object"),
        (b'"llama"', "expected an object"),
        (b"{", "not UTF-8 JSON"),
        (json.dumps({"x": "y" * (300 * 1024)}).encode(), "larger than 262144 bytes"),
        (json.dumps({"x": ["\u00e9" * 50_000]}, ensure_ascii=False).encode(), "re-serialised, over"),
        (b'{"a":' * 17 + b"1" + b"}" * 17, "nested deeper than 16"),
    ],
)
def test_a_bad_config_is_an_error(tmp_path: Path, config: bytes, why: str) -> None:
    with_config(tmp_path)
    (tmp_path / "config.json").write_bytes(config)
    found = read_model_files(tmp_path)
    assert found.error is not None and why in found.error and found.config is None


def test_missing_and_unreadable_files_are_errors(tmp_path: Path) -> None:
    assert read_model_files(tmp_path / "absent").error is not None
    d = with_config(tmp_path / "dir-config")
    (d / "config.json").unlink()
    (d / "config.json").mkdir()  # an OSError other than "missing" (the tests may run as root)
    found = read_model_files(d)
    assert found.error is not None and found.error.startswith("config.json:")


def test_no_safetensors_keeps_the_config_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    found = read_model_files(tmp_path)
    assert found.config == {"model_type": "llama"} and found.checkpoint is None
    assert found.error == "no .safetensors files" and not found.complete


def test_too_many_files_layers_or_dtypes_are_errors(tmp_path: Path) -> None:
    many = with_config(tmp_path / "files")
    for i in range(4097):
        (many / f"x-{i}.safetensors").touch()
    assert "more than 4096 .safetensors files" in (read_model_files(many).error or "")

    layers = {f"model.layers.{i}.mlp.down_proj.weight": ("BF16", [1]) for i in range(4097)}
    write_model(tmp_path / "layers", [layers])
    assert "more than 4096 layers" in (read_model_files(tmp_path / "layers").error or "")

    far = {"model.layers.2000000.mlp.down_proj.weight": ("BF16", [1])}
    write_model(tmp_path / "far", [far])
    assert "layer index over" in (read_model_files(tmp_path / "far").error or "")

    header = {f"w{i}": {"dtype": f"X{i}", "shape": [1], "data_offsets": [0, 1]} for i in range(33)}
    raw = json.dumps(header).encode()
    _raw(with_config(tmp_path / "dtypes") / "model.safetensors", struct.pack("<Q", len(raw)) + raw)
    assert "more than 32 dtypes" in (read_model_files(tmp_path / "dtypes").error or "")


def test_a_modelopt_checkpoints_quantisation_travels_with_its_config(tmp_path: Path) -> None:
    # ModelOpt keeps its quantisation in hf_quant_config.json beside config.json; vLLM reads
    # both, and the planner needs it to size the weights at 8 bits
    tensors = {"model.layers.0.mlp.down_proj.weight": ("F8_E4M3", [64, 128])}
    write_model(tmp_path, [tensors])
    quant = {
        "producer": {"name": "modelopt"},
        "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]},
    }
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(quant))
    found = read_model_files(tmp_path)
    assert found.error is None and found.config is not None
    assert found.config["hf_quant_config"] == quant
