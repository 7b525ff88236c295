"""The agent's reader of the served model's files (`model_files`, `model_watch`): where vLLM's
model lives, what its safetensors headers say per tensor role, the bounds, and the launched
agent reporting what the fake vLLM downloaded."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from launched import AGENT_ROOT, agent_port, launcher_cmd, report_when, start, stop
from model_checkpoints import LLAMA3_8B_CONFIG, LLAMA3_8B_PARAMS, write_model

from rankguard_agent.model_files import (
    ModelFiles,
    download_complete,
    hf_hub_cache,
    model_dir,
    read_model_files,
    tensor_role,
)
from rankguard_agent.model_watch import ModelWatch
from rankguard_agent.report import Report
from rankguard_agent.report_model import LayerTally, ParamTally
from rankguard_sim import fake_vllm, gpus
from rankguard_sim.scenario_file import SCENARIO_ENV, builtin_dir

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "sim" / "rankguard_sim" / "bin" / "vllm"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


# -- where the model lives ----------------------------------------------------------------------


def hf_repo(cache: Path, repo_id: str, refs: dict[str, str], snapshots: list[str]) -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for ref, commit in refs.items():
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    for commit in snapshots:
        (repo / "snapshots" / commit).mkdir(parents=True)
    return repo


@pytest.mark.parametrize(
    "argv",
    [
        ["vllm", "serve", "{d}", "-tp", "2"],
        ["vllm", "serve", "--model", "{d}"],
        ["vllm", "serve", "--model={d}", "--port", "8000"],
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "{d}"],
    ],
)
def test_a_local_directory_is_used_as_given(tmp_path: Path, argv: list[str]) -> None:
    d = tmp_path / "llama"
    d.mkdir()
    assert model_dir([a.format(d=d) for a in argv], {}) == d
    assert model_dir([a.format(d=tmp_path / "absent") for a in argv], {}) is None


def test_a_repo_id_resolves_through_refs_main_in_each_cache_location(tmp_path: Path) -> None:
    argv = ["vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct"]
    for env, cache in [
        ({"HF_HUB_CACHE": str(tmp_path / "a")}, tmp_path / "a"),
        ({"HF_HOME": str(tmp_path / "b")}, tmp_path / "b" / "hub"),
        ({"HOME": str(tmp_path / "c")}, tmp_path / "c" / ".cache" / "huggingface" / "hub"),
        (
            {"HOME": str(tmp_path / "c"), "XDG_CACHE_HOME": str(tmp_path / "d")},
            tmp_path / "d" / "huggingface" / "hub",
        ),
        ({"HF_HUB_CACHE": str(tmp_path / "e"), "HF_HOME": str(tmp_path / "b")}, tmp_path / "e"),
    ]:
        assert hf_hub_cache(env) == cache
        assert model_dir(argv, env) is None  # not downloaded yet
        repo = hf_repo(cache, "meta-llama/Meta-Llama-3-8B-Instruct", {"main": COMMIT}, [COMMIT])
        assert model_dir(argv, env) == repo / "snapshots" / COMMIT


def test_revisions_and_the_download_dir(tmp_path: Path) -> None:
    cache = tmp_path / "dl"
    repo = hf_repo(cache, "Qwen/Qwen2-7B", {"main": COMMIT, "v2": OTHER, "pr/3": OTHER}, [COMMIT, OTHER])
    base = ["vllm", "serve", "Qwen/Qwen2-7B"]
    env = {"HOME": str(tmp_path / "home")}  # the default cache is empty: --download-dir wins
    assert model_dir([*base, "--download-dir", str(cache)], env) == repo / "snapshots" / COMMIT
    assert model_dir([*base, f"--download_dir={cache}"], env) == repo / "snapshots" / COMMIT
    assert (
        model_dir([*base, "--download-dir", str(cache), "--revision", "v2"], env)
        == repo / "snapshots" / OTHER
    )
    assert (
        model_dir([*base, "--download-dir", str(cache), "--revision=pr/3"], env) == repo / "snapshots" / OTHER
    )
    # A commit is its own snapshot: no ref is read.
    assert (
        model_dir([*base, "--download-dir", str(cache), "--revision", OTHER], env)
        == repo / "snapshots" / OTHER
    )
    missing = "a" * 40
    assert model_dir([*base, "--download-dir", str(cache), "--revision", missing], env) is None
    assert model_dir([*base, "--download-dir", str(cache), "--revision", "nope"], env) is None
    assert model_dir([*base], env) is None
    (repo / "refs" / "main").write_text("not a commit")
    assert model_dir([*base, "--download-dir", str(cache)], env) is None


def test_a_command_without_a_model_or_with_a_strange_one_has_no_directory(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path)}
    assert model_dir(["vllm", "serve"], env) is None
    assert model_dir(["vllm", "serve", "--port", "8000"], env) is None
    assert model_dir(["python", "-c", "pass"], env) is None
    assert model_dir(["vllm", "serve", "--model"], env) is None
    assert model_dir(["vllm", "serve", "a/b/c"], env) is None
    assert model_dir(["vllm", "serve", "./not-here"], env) is None
    assert model_dir(["vllm", "serve", str(tmp_path / "weights.gguf")], env) is None


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


def _with_config(tmp_path: Path) -> Path:
    write_model(tmp_path, [{"model.norm.weight": ("BF16", [8])}])
    return tmp_path


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
    _raw(_with_config(tmp_path) / "model.safetensors", data)
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
    _raw(_with_config(tmp_path) / "model.safetensors", struct.pack("<Q", len(raw)) + raw)
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
    _with_config(tmp_path)
    (tmp_path / "config.json").write_bytes(config)
    found = read_model_files(tmp_path)
    assert found.error is not None and why in found.error and found.config is None


def test_missing_and_unreadable_files_are_errors(tmp_path: Path) -> None:
    assert read_model_files(tmp_path / "absent").error is not None
    d = _with_config(tmp_path / "dir-config")
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
    many = _with_config(tmp_path / "files")
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
    _raw(_with_config(tmp_path / "dtypes") / "model.safetensors", struct.pack("<Q", len(raw)) + raw)
    assert "more than 32 dtypes" in (read_model_files(tmp_path / "dtypes").error or "")


def test_download_complete_waits_for_every_indexed_shard(tmp_path: Path) -> None:
    tensors = llama_tensors(1)
    names = list(tensors)
    write_model(tmp_path, [{n: tensors[n] for n in names[:5]}, {n: tensors[n] for n in names[5:]}])
    second = tmp_path / "model-00002-of-00002.safetensors"
    kept = second.read_bytes()
    second.unlink()
    assert not download_complete(tmp_path)
    found = read_model_files(tmp_path)
    assert found.error is None and not found.complete  # what is there is read, but it is partial
    second.write_bytes(kept)
    assert download_complete(tmp_path) and read_model_files(tmp_path).complete
    (tmp_path / "config.json").unlink()
    assert not download_complete(tmp_path)


# -- the watch (one poll at a time: no timing) -----------------------------------------------------


def test_the_watch_waits_for_the_download_then_reads_once(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    published: list[ModelFiles] = []
    loaded = [False]
    watch = ModelWatch(
        ["vllm", "serve", "org/tiny"], {"HF_HUB_CACHE": str(cache)}, published.append, lambda: loaded[0]
    )
    assert watch.poll() is False and published == []  # nothing downloaded yet
    repo = hf_repo(cache, "org/tiny", {"main": COMMIT}, [COMMIT])
    snap = repo / "snapshots" / COMMIT
    (snap / "config.json").write_text("{}")
    assert watch.poll() is False and published == []  # config only: the weights are still coming
    tensors = llama_tensors(1)
    write_model(snap, [tensors])
    assert watch.poll() is True
    assert len(published) == 1 and published[0].error is None and published[0].complete


def test_the_watch_gives_up_when_the_engine_loaded_from_elsewhere(tmp_path: Path) -> None:
    published: list[ModelFiles] = []
    loaded = [False]
    watch = ModelWatch(
        ["vllm", "serve", "s3://bucket/m"],
        {"HF_HUB_CACHE": str(tmp_path)},
        published.append,
        lambda: loaded[0],
    )
    assert watch.poll() is False
    loaded[0] = True
    assert watch.poll() is True
    assert [(f.path, f.error) for f in published] == [("s3://bucket/m", "the model's files were not found")]


def test_the_watch_retries_a_failing_read_a_few_times(tmp_path: Path) -> None:
    d = _with_config(tmp_path)
    (d / "config.json").write_text("[]")
    published: list[ModelFiles] = []
    watch = ModelWatch(["vllm", "serve", str(d)], {}, published.append)
    results = [watch.poll() for _ in range(5)]
    assert results == [False, False, False, False, True]
    assert all(f.error and "expected an object" in f.error for f in published)


# -- the launched agent and the fake vLLM's download ------------------------------------------------


async def test_the_launched_agent_reports_the_files_the_fake_vllm_downloaded(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    doc = yaml.safe_load((builtin_dir() / "llama3-8b-tp2-24gb.yaml").read_text())
    (tmp_path / "llama3-8b.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    doc["model_config"] = "llama3-8b.json"  # next to the scenario
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(doc))
    root = tmp_path / "world-gpus"
    uuids = gpus.create_gpus(root, 2, round(23.58 * (1 << 30)), seed="model-files")
    home = tmp_path / "home"
    env = dict(sim_env)
    env.update(
        {  # PATH: the shim runs `python3`, which must be this one (aiohttp)
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join([str(AGENT_ROOT), str(REPO / "sim")]),
            "HOME": str(home),
            gpus.GPU_ROOT_ENV: str(root),
            gpus.VISIBLE_DEVICES_ENV: ",".join(uuids),
            SCENARIO_ENV: str(scenario),
            fake_vllm.TIME_SCALE_ENV: "50",
            fake_vllm.PEAK_HOLD_ENV: "0.05",
        }
    )
    env.pop("HF_HOME", None)
    env.pop("HF_HUB_CACHE", None)
    child = [
        str(SHIM),
        "serve",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "-tp",
        "2",
        "--gpu-memory-utilization",
        "0.85",
        "--port",
        "0",
    ]
    proc = await start(launcher_cmd(tmp_path / "tl", child), env)
    try:
        port = await agent_port(proc, 30)

        def read(r: Report) -> bool:
            return r.model is not None and r.model.checkpoint is not None

        report = await report_when(port, read, timeout=60)
    finally:
        await stop(proc)
    model = report.model
    assert model is not None and model.error is None, model
    hub = home / ".cache" / "huggingface" / "hub" / "models--meta-llama--Meta-Llama-3-8B-Instruct"
    commit = (hub / "refs" / "main").read_text()
    assert model.path == str(hub / "snapshots" / commit)
    assert model.config == LLAMA3_8B_CONFIG
    ck = model.checkpoint
    assert ck is not None
    assert ck.total_bytes == ck.index_total_size == 2 * LLAMA3_8B_PARAMS == 16_060_522_496
    assert ck.files == 4 and ck.bytes_by_dtype == {"BF16": 16_060_522_496}
    assert ck.roles["embed"] == ck.roles["head"] == ParamTally(128256 * 4096, 0)
    assert [layer.index for layer in ck.layers] == list(range(32))
    assert ck.layers[0].kv == ParamTally(2 * 1024 * 4096, 0)
    assert ck.layers[0].replicated == ParamTally(2 * 4096, 0)
    assert report.dropped_fields == []
    # Header-only: the "download" of a 16 GB checkpoint is a few kilobytes.
    assert sum(f.stat().st_size for f in (hub / "blobs").iterdir()) < 1 << 20


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
