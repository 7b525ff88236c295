"""Where a service's model shape comes from (core/model/resolve.py), and weights from the
checkpoint's own headers (core/model/checkpoint.py) held against config.json arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rankguard_agent.model_files import read_model_files
from rankguard_operator.core.budget.bounds import initial_plan, prior_plan
from rankguard_operator.core.budget.memory_model import pp_layer_partition, weight_bytes
from rankguard_operator.core.model.catalog import CATALOG, CATALOG_ENTRIES
from rankguard_operator.core.model.checkpoint import CheckpointError, checkpoint_rank_weights
from rankguard_operator.core.model.resolve import (
    MAX_CONFIG_JSON,
    ConfigRead,
    LearnedModel,
    config_from_configmap,
    learned_from_report,
    model_event,
    resolve,
)
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB
from rankguard_sim.fake_vllm.hf_download import checkpoint_files

LLAMA70 = dict(CATALOG_ENTRIES["llama-3-70b"]["config"])


def spec(model: dict[str, Any], **more: Any) -> Any:
    return parse_spec({"model": model, "image": "vllm/vllm-openai:v0.33.0", "tensorParallelSize": 4, **more})


def learned(config: dict[str, Any] | None = None, checkpoint: dict[str, Any] | None = None) -> LearnedModel:
    found = learned_from_report(config, checkpoint)
    assert found is not None
    return found


def test_a_catalog_model_is_planned_from_the_catalog() -> None:
    m = resolve(spec({"name": "meta-llama/Meta-Llama-3-70B-Instruct"}))
    assert (m.source, m.measure_first) == ("catalog", False)
    assert m.condition()[:2] == ("True", "Planned")


def test_an_unknown_model_is_measured_first_until_the_agent_reads_its_config() -> None:
    s = spec({"name": "acme-corp/support-70b"})
    m = resolve(s)
    assert m.shape is None and m.measure_first and "not in rankguard's catalog" in m.reason
    assert prior_plan(s, 80 * GiB, m) is None  # nothing to plan from priors
    m = resolve(s, learned=learned(LLAMA70))
    assert (m.source, m.measure_first) == ("agent", False)
    assert m.shape is not None and m.shape.num_layers == 80
    assert prior_plan(s, 80 * GiB, m) is not None


def test_precedence_config_map_over_agent_over_catalog() -> None:
    other = {**LLAMA70, "num_hidden_layers": 40}
    s = spec({"name": "meta-llama/Meta-Llama-3-70B", "configMap": {"name": "cm"}})
    m = resolve(s, ConfigRead(doc=other), learned(LLAMA70))
    assert m.source == "configMap" and m.shape is not None and m.shape.num_layers == 40
    m = resolve(spec({"name": "meta-llama/Meta-Llama-3-70B"}), None, learned(other))
    assert m.source == "agent" and m.shape is not None and m.shape.num_layers == 40


@pytest.mark.parametrize(
    ("cm", "why"),
    [
        (None, "does not exist"),
        ({"data": {"other": "{}"}}, "has no key 'config.json' (its keys: other)"),
        ({"data": {"config.json": "{not json"}}, "is not JSON"),
        ({"data": {"config.json": "[1]"}}, "must hold a JSON object"),
        ({"data": {"config.json": " " * (300 * 1024)}}, "over"),
    ],
)
def test_a_bad_config_map_is_a_condition_not_a_plan(cm: Any, why: str) -> None:
    read = config_from_configmap(cm, "cm", "config.json")
    assert read.doc is None and read.error is not None and why in read.error
    m = resolve(spec({"name": "x/y", "configMap": {"name": "cm"}}), read)
    assert m.measure_first and why in m.message


def test_a_config_that_contradicts_itself_names_the_field() -> None:
    bad = {**LLAMA70, "num_key_value_heads": 128}
    m = resolve(spec({"name": "x/y", "configMap": {"name": "cm"}}), ConfigRead(doc=bad))
    assert m.shape is None and "num_key_value_heads (128) exceeds num_attention_heads (64)" in m.reason


def test_a_split_the_model_cannot_take_is_a_spec_error() -> None:
    s = parse_spec({"model": {"name": "x/y"}, "image": "vllm/vllm-openai:v0.33.0", "tensorParallelSize": 3})
    with pytest.raises(SpecError, match="must divide the 64 attention heads"):
        resolve(s, learned=learned(LLAMA70))


def test_runtime_fp8_on_a_quantised_checkpoint_is_refused() -> None:
    fp8 = dict(CATALOG_ENTRIES["qwen3-32b-fp8"]["config"])
    s = parse_spec(
        {
            "model": {"name": "x/y", "quantization": "fp8"},
            "image": "vllm/vllm-openai:v0.33.0",
            "tensorParallelSize": 4,
        }
    )
    with pytest.raises(SpecError, match="already quantised"):
        resolve(s, learned=learned(fp8))


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
            "speculative decoding",
        ),
        (["--enable-lora"], "LoRA adapters"),
        (
            ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
            "KV connector",
        ),
    ],
)
def test_serving_features_the_planner_does_not_model_go_measure_first(extra: list[str], why: str) -> None:
    m = resolve(spec({"name": "meta-llama/Meta-Llama-3-70B"}, engine={"extraArgs": extra}))
    assert m.measure_first and why in m.reason


def test_turning_a_feature_off_is_not_a_reason() -> None:
    m = resolve(spec({"name": "meta-llama/Meta-Llama-3-70B"}, engine={"extraArgs": ["--no-enable-lora"]}))
    assert not m.measure_first


def test_what_the_agent_reports_is_reduced_and_bounded() -> None:
    doc = {**LLAMA70, "unrelated": "x" * 1000}
    kept = learned(doc)
    assert kept.config is not None and "unrelated" not in kept.config
    huge = {**LLAMA70, "layer_types": ["full_attention"] * (MAX_CONFIG_JSON // 10)}
    assert learned_from_report(huge, None) is None  # too big to keep: ignored, never stored
    assert learned_from_report(None, {"roles": {}, "layers": [[0, [1, 2]]]}) is not None  # kept as text
    assert LearnedModel.from_status({"config": "{not json"}) is not None
    assert LearnedModel.from_status({"config": "{not json"}).config_doc() is None  # type: ignore[union-attr]


def test_one_event_per_change_of_how_the_model_is_known() -> None:
    s = spec({"name": "acme-corp/support-70b"})
    first = resolve(s)
    assert model_event(None, first) == ("Warning", "ModelMeasureFirst", first.message)
    assert model_event(first.to_status(None), first) is None  # same reason: no repeat
    planned = resolve(s, learned=learned(LLAMA70))
    assert model_event(first.to_status(None), planned)[:2] == ("Normal", "ModelResolved")  # type: ignore[index]
    assert model_event(planned.to_status(None), planned) is None
    catalog = resolve(spec({"name": "meta-llama/Meta-Llama-3-70B"}))
    assert model_event(None, catalog) is None  # planned from the first pass: the condition says it


def _summary(tmp_path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """What the agent reports for the checkpoint the fake vLLM would write for `config`."""
    for name, data in checkpoint_files(config).items():
        (tmp_path / name).write_bytes(data)
    found = read_model_files(tmp_path)
    assert found.error is None and found.checkpoint is not None
    return found.checkpoint.to_doc()


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (4, 1), (2, 2), (16, 1)])
def test_checkpoint_headers_and_config_arithmetic_agree(tmp_path: Path, tp: int, pp: int) -> None:
    summary = _summary(tmp_path, LLAMA70)
    shape = CATALOG["llama-3-70b"]
    stages = pp_layer_partition(shape.num_layers, pp)
    from_headers = checkpoint_rank_weights(summary, shape, tp=tp, pp=pp, stages=stages, act=2)
    for rank, got in enumerate(from_headers):
        stage = rank // tp
        planned = weight_bytes(shape, tp, pp_stage=stage, pp=pp, layers=stages[stage])
        assert got == pytest.approx(planned, rel=0.002), (rank, got, planned)


def test_runtime_fp8_halves_the_linear_layers_read_from_headers(tmp_path: Path) -> None:
    summary = _summary(tmp_path, LLAMA70)
    shape = CATALOG["llama-3-70b"]
    bf16 = checkpoint_rank_weights(summary, shape, tp=1, pp=1, stages=(80,), act=2)[0]
    fp8 = checkpoint_rank_weights(summary, shape, tp=1, pp=1, stages=(80,), act=2, runtime_fp8=True)[0]
    assert 0.5 < fp8 / bf16 < 0.55  # embeddings and norms stay 16-bit


def test_a_summary_that_does_not_fit_the_model_is_not_used(tmp_path: Path) -> None:
    summary = _summary(tmp_path, {**LLAMA70, "num_hidden_layers": 40})
    with pytest.raises(CheckpointError, match="no tensors for 40 of the model's 80 layers"):
        checkpoint_rank_weights(summary, CATALOG["llama-3-70b"], tp=1, pp=1, stages=(80,), act=2)
    s = spec({"name": "meta-llama/Meta-Llama-3-70B"}, memory={"gpuMemoryBytes": 80 * GiB})
    m = resolve(s, learned=learned(LLAMA70, summary))
    assert m.checkpoint is None  # arithmetic instead, never a wrong per-rank figure
    plan = initial_plan(s, model=m)
    assert plan is not None and {r.weights_source for r in plan.ranks} == {"config"}


def test_a_fitting_summary_gives_the_plan_its_weights(tmp_path: Path) -> None:
    summary = _summary(tmp_path, LLAMA70)
    s = spec({"name": "meta-llama/Meta-Llama-3-70B"}, memory={"gpuMemoryBytes": 80 * GiB})
    m = resolve(s, learned=learned(LLAMA70, summary))
    plan = initial_plan(s, model=m)
    assert plan is not None and {r.weights_source for r in plan.ranks} == {"checkpoint"}
    assert json.loads(m.to_status(learned(LLAMA70, summary))["checkpoint"])["files"] >= 1


def test_files_read_for_another_model_never_count() -> None:
    # the agent read acme-corp/support-70b; the spec now names another model nothing knows
    old = learned_from_report(LLAMA70, None, "acme-corp/support-70b")
    m = resolve(spec({"name": "acme-corp/other-8b"}), learned=old)
    assert m.shape is None and m.measure_first
    kept = LearnedModel.from_status(
        resolve(spec({"name": "acme-corp/support-70b"}), learned=old).to_status(old)
    )
    assert kept is not None and kept.name == "acme-corp/support-70b"
