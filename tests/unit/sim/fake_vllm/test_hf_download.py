"""The fake vLLM's "download": scenario `model_config`, the tensors derived from it, and the
header-only checkpoint it writes into the Hugging Face cache (read back with the agent's reader)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankguard_agent.model_files import model_dir, read_model_files
from rankguard_agent.wire.report_model import ParamTally
from rankguard_sim.fake_vllm.hf_download import download, hf_hub_cache
from rankguard_sim.physics.checkpoint_tensors import checkpoint_tensors
from rankguard_sim.physics.scenario_data import ScenarioError
from rankguard_sim.physics.scenario_file import builtin_dir, builtin_names, load_scenario, parse_scenario
from tests.unit.model_checkpoints import LLAMA3_8B_CONFIG, LLAMA3_8B_PARAMS

# Qwen/Qwen1.5-MoE-A2.7B's config.json (the parts the layout needs, as published).
QWEN2_MOE: dict[str, Any] = {
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "num_hidden_layers": 24,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def scenario_doc() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((builtin_dir() / "llama3-8b-tp2-24gb.yaml").read_text())
    return doc


def test_the_llama3_8b_layout_adds_up_to_the_published_size() -> None:
    tensors = checkpoint_tensors(LLAMA3_8B_CONFIG)
    assert sum(t.nbytes for t in tensors) == 2 * LLAMA3_8B_PARAMS
    assert len(tensors) == 2 + 1 + 32 * 9


def test_a_qwen2_moe_layout_reads_back_with_its_roles(tmp_path: Path) -> None:
    snapshot = download(tmp_path, "Qwen/Qwen1.5-MoE-A2.7B", QWEN2_MOE)
    found = read_model_files(snapshot)
    assert found.error is None and found.complete and found.config == QWEN2_MOE
    ck = found.checkpoint
    assert ck is not None and ck.files > 1 and ck.index_total_size == ck.total_bytes
    layer = ck.layers[0]
    experts = 60 * 3 * 1408 * 2048 + 3 * 5632 * 2048  # routed + shared expert
    assert layer.split == ParamTally(2 * 2048 * 2048 + 2048 + experts, 0)  # q (and its bias), o, experts
    assert layer.kv == ParamTally(2 * (2048 * 2048 + 2048), 0)  # k, v and their biases
    assert layer.replicated == ParamTally(2 * 2048 + 60 * 2048 + 2048, 0)  # norms, router, shared gate


def test_download_lays_out_the_hf_cache_and_is_idempotent(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    cache = hf_hub_cache(env)
    first = download(cache, "meta-llama/Meta-Llama-3-8B-Instruct", LLAMA3_8B_CONFIG)
    assert model_dir(["vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct"], env) == first
    assert sorted(p.name for p in first.iterdir()) == [
        "config.json",
        *[f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)],
        "model.safetensors.index.json",
    ]
    assert all(p.is_symlink() for p in first.iterdir())
    assert download(cache, "meta-llama/Meta-Llama-3-8B-Instruct", LLAMA3_8B_CONFIG) == first
    pinned = download(cache, "meta-llama/Meta-Llama-3-8B-Instruct", LLAMA3_8B_CONFIG, "c" * 40)
    assert pinned.name == "c" * 40
    branch = download(cache, "meta-llama/Meta-Llama-3-8B-Instruct", LLAMA3_8B_CONFIG, "v2")
    argv = ["vllm", "serve", "meta-llama/Meta-Llama-3-8B-Instruct", "--revision", "v2"]
    assert model_dir(argv, env) == branch


def test_model_config_inline_or_as_a_file_next_to_the_scenario(tmp_path: Path) -> None:
    doc = scenario_doc()
    doc["model_config"] = LLAMA3_8B_CONFIG
    assert parse_scenario(doc).model_config == LLAMA3_8B_CONFIG
    (tmp_path / "cfg.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    doc["model_config"] = "cfg.json"
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    assert load_scenario(tmp_path / "s.yaml").model_config == LLAMA3_8B_CONFIG


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({**LLAMA3_8B_CONFIG, "num_hidden_layers": 80}, "num_layers 80 disagrees"),
        ({**LLAMA3_8B_CONFIG, "vocab_size": 32000}, "vocab_size 32000 disagrees"),
        ({**LLAMA3_8B_CONFIG, "torch_dtype": "int4"}, "dtype"),
        ({k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "hidden_size"}, "hidden_size"),
        ([1, 2], "expected the config.json object"),
        ("absent.json", "cannot read"),
    ],
)
def test_a_model_config_that_does_not_fit_the_scenario_is_refused(config: Any, why: str) -> None:
    doc = scenario_doc()
    doc["model_config"] = config
    with pytest.raises(ScenarioError, match=why):
        parse_scenario(doc, path=str(builtin_dir() / "x.yaml"))


def test_only_private_models_come_with_their_own_config() -> None:
    # a built-in scenario carries a model_config only for a model no catalog knows (the fake
    # downloads it into the pod's Hugging Face cache); the others write nothing
    with_config = {n for n in builtin_names() if load_scenario(n).model_config is not None}
    assert with_config == {"support-70b-tp4"}
    assert load_scenario("support-70b-tp4").model.name == "acme-corp/support-70b"
