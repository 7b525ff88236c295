"""Multimodal towers per TP rank, nested-config defaults, tied embeddings, and gpt-oss MXFP4 weights,
from the published config.json files in the catalog (issue 28, "weights per rank")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.model.catalog import CATALOG, CATALOG_ENTRIES
from rankguard_operator.core.model.hf_config import shape_from_hf_config
from rankguard_operator.core.model.vision import ARCH_DEFAULTS
from rankguard_operator.core.model.weights import rank_weight_bytes
from rankguard_operator.core.units import GiB
from tests import REPO

OBSERVATIONS = REPO / "tests" / "fixtures" / "vllm_observations.json"


def _weights(shape: Any, tp: int) -> int:
    return rank_weight_bytes(
        shape,
        tp,
        range(shape.num_layers),
        first_stage=True,
        last_stage=True,
        pp=1,
        act=2,
        quant=shape.quant,
    )


def _gemma3_wrapper() -> dict[str, Any]:
    """The published gemma-3-1b-it text config nested the way google/gemma-3-*-it publish theirs:
    under text_config, without vocab_size or tie_word_embeddings (transformers' defaults)."""
    text = dict(CATALOG_ENTRIES["gemma-3-1b"]["config"])
    for k in ("vocab_size", "tie_word_embeddings", "architectures"):
        text.pop(k, None)
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text}


def test_gemma3_nested_config_takes_the_architecture_defaults() -> None:
    flat = CATALOG["gemma-3-1b"]
    nested = shape_from_hf_config(_gemma3_wrapper())
    assert nested.vocab_size == ARCH_DEFAULTS["gemma3_text"]["vocab_size"]
    # tied once, as Gemma3TextConfig / Gemma3Config default: the same weights as the flat file
    assert nested.tie_word_embeddings
    assert (
        nested.num_params() - nested.vision_params
        == flat.num_params() + (nested.vocab_size - flat.vocab_size) * flat.hidden_size
    )
    # no vision_config: Gemma3Config builds a SigLIP tower from its defaults, counted
    assert nested.vision_params > 0


def test_arch_defaults_are_the_snapshot_naming_transformers_and_a_class_per_type() -> None:
    arch = vllm_snapshots.latest().arch
    # recorded from the real package by hack/vllm-snapshot/arch_defaults.py, not a table in vision.py
    assert arch["defaults"] == ARCH_DEFAULTS
    assert vllm_snapshots.version_key(arch["transformers"]) is not None
    assert set(arch["classes"]) == set(ARCH_DEFAULTS)
    for model_type, dotted in arch["classes"].items():
        module, _, name = dotted.rpartition(".")
        assert module.split(".")[0] in ("transformers", "vllm"), model_type
        assert name.endswith("Config"), model_type
        assert ARCH_DEFAULTS[model_type], model_type


def test_a_stated_tie_wins_over_the_default() -> None:
    doc = _gemma3_wrapper()
    doc["tie_word_embeddings"] = False
    untied = shape_from_hf_config(doc)
    tied = shape_from_hf_config(_gemma3_wrapper())
    assert untied.num_params() - tied.num_params() == tied.vocab_size * tied.hidden_size


@pytest.mark.parametrize(
    "key", ["qwen2.5-vl-7b", "qwen3-vl-8b", "llama-4-scout-17b-16e-instruct-fp8-dynamic"]
)
def test_vision_tower_whole_on_every_rank_unless_split_is_known(key: str) -> None:
    shape = CATALOG[key]
    assert not shape.unmodelled
    assert shape.vision_params > 0
    assert shape.vision_replicated_params is not None
    assert 0 < shape.vision_replicated_params < shape.vision_params
    # default: the planner cannot see --mm-encoder-tp-mode, so the whole tower on every rank
    assert shape.vision_params_per_rank(1) == shape.vision_params_per_rank(4) == shape.vision_params
    # "weights" mode: the split part divides, the replicated part does not
    split4 = shape.vision_params_per_rank(4, encoder_tp=True)
    assert split4 == shape.vision_replicated_params + -(
        -(shape.vision_params - shape.vision_replicated_params) // 4
    )
    # a TP size that does not divide the tower's heads: vLLM runs it data-parallel (whole)
    assert shape.vision_params_per_rank(3, encoder_tp=True) == shape.vision_params
    # TP4 weights carry the whole tower: 3/4 of it more than a 1/tp split would
    text_only = _weights(shape, 4) - shape.vision_params * 2
    assert text_only > 0


def test_qwen3_vl_counts_its_deepstack_mergers() -> None:
    shape = CATALOG["qwen3-vl-8b"]
    vision = dict(CATALOG_ENTRIES["qwen3-vl-8b"]["config"]["vision_config"])
    without = dict(
        CATALOG_ENTRIES["qwen3-vl-8b"]["config"], vision_config={**vision, "deepstack_visual_indexes": []}
    )
    assert shape.vision_params > shape_from_hf_config(without).vision_params


def _logged(obs_id: str) -> float:
    rows = json.loads(OBSERVATIONS.read_text(encoding="utf-8"))
    rows = rows if isinstance(rows, list) else rows["observations"]
    return float(next(r for r in rows if r["id"] == obs_id)["weights_gib"])


@pytest.mark.parametrize(
    ("key", "tp", "obs_id"),
    [
        ("gpt-oss-120b", 1, "gpt-oss-120b-tp1-h100-vllm0.10.x-negative-kv"),
        ("gpt-oss-120b", 1, "gpt-oss-120b-tp1-h100-vllm0.14.1"),
        ("gpt-oss-120b", 4, "gpt-oss-120b-tp4-a100-80gb-vllm0.10.1.1"),
        ("gpt-oss-20b", 1, "gpt-oss-20b-tp1-a100-vllm0.19.0"),
    ],
)
def test_gpt_oss_mxfp4_weights_within_3_percent_of_the_logs(key: str, tp: int, obs_id: str) -> None:
    planned = _weights(CATALOG[key], tp) / GiB
    logged = _logged(obs_id)
    assert abs(planned / logged - 1) <= 0.03, (planned, logged)


def test_mxfp4_pads_hidden_to_256_and_intermediate_to_128() -> None:
    q = CATALOG["gpt-oss-120b"].quant
    assert q is not None
    assert (q.expert_hidden_padding, q.expert_padding) == (256, 128)
