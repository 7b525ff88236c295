"""What vLLM's config build checks of a value its parser passes, held at apply time from the
snapshot (surface.json's `value_bounds`, `value_names`, `dict_options`, `kv_connectors`, read
from the real package by hack/vllm-snapshot/surface.py). The extraArgs tables hold the lot
(test_surface.py); these name the refusal a person reads, and what a release recorded before
these keys gets (nothing: the rules skip it, the pod's own vLLM judges).
"""

from __future__ import annotations

from typing import Any

import pytest

from rankguard_operator.core.engine.rules import rules_for
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec

V33 = "vllm/vllm-openai:v0.33.0"
V34 = "vllm/vllm-openai:v0.34.0"
V32 = "vllm/vllm-openai:v0.32.0"  # recorded before surface.json carried these keys


def refusal(extra: list[str], image: str = V33) -> str | None:
    spec: dict[str, Any] = {
        "model": {"name": "org/model"},
        "image": image,
        "tensorParallelSize": 2,
        "engine": {"extraArgs": extra},
    }
    try:
        parse_spec(spec)
    except SpecError as e:
        return str(e)
    return None


@pytest.mark.parametrize("image", [V33, V34])
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--dp-sync-interval", "0"], "spec.engine.extraArgs[0] '--dp-sync-interval 0': vLLM requires >= 1"),
        (["--stream-interval=-1"], "'--stream-interval -1': vLLM requires >= 1"),
        (["--kv-cache-metrics-sample", "0"], "'--kv-cache-metrics-sample 0': vLLM requires > 0"),
        (["--attention-backend", "none"], "'--attention-backend none': vLLM 0.3"),
        (["--mamba-backend", "auto"], "'--mamba-backend auto': vLLM 0.3"),
        (["--config-format", "None"], "'--config-format None': vLLM 0.3"),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "x_y": 1}'], "no x_y"),
        (["--watermark-config", "{}"], "WatermarkConfig needs key"),
        (["--enable-dbo"], "--enable-dbo needs --all2all-backend"),
        (["--default-mm-loras=-1"], "--default-mm-loras takes a JSON object"),
        (["--enable-lora", "--max-loras", "0"], "'--max-loras 0': vLLM requires >= 1"),
    ],
)
def test_a_value_vllm_refuses_when_it_builds_the_config_is_refused_at_apply(
    extra: list[str], needle: str, image: str
) -> None:
    why = refusal(extra, image)
    assert why is not None and needle in why, why


@pytest.mark.parametrize(
    "extra",
    [
        ["--dp-sync-interval", "1"],
        ["--attention-backend", "flash_attn"],  # upper-cased by vLLM, as the snapshot records
        ["--attention-backend", "auto"],
        ["--mamba-backend", "flashinfer"],
        ["--config-format", "hf"],
        ["--max-loras", "0"],  # no --enable-lora: vLLM builds no LoRA config
        ["--mm-processor-cache-gb=-1"],  # a text model builds no multimodal config: the pod judges
        ["--default-mm-loras", "0"],  # falsy: unset to vLLM
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt-lookup-max": 4}'],
    ],
)
def test_what_vllm_builds_and_runs_stays_accepted(extra: list[str]) -> None:
    assert refusal(extra) is None


def test_sampling_replay_needs_processed_logprobs_from_the_release_that_checks_it() -> None:
    assert refusal(["--return-sampling-mask"], V33) is None  # 0.33 runs it
    why = refusal(["--return-sampling-mask"], V34)
    assert why is not None and "--logprobs-mode processed_logprobs" in why
    assert refusal(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs"], V34) is None


def test_the_names_and_bounds_are_the_snapshots_not_typed_here() -> None:
    cli = rules_for("0.33.0").cli
    bound = cli.value_bounds["dp_sync_interval"]
    assert bound == {"bounds": {"ge": 1}, "field": "ParallelConfig.dp_sync_interval"}
    assert cli.value_names["mamba_backend"]["fold"] == "upper"
    assert "NixlConnector" in cli.kv_connectors  # 0.33's engine.json lists none: surface.json's
    assert "kv_role" in cli.json_options["kv_transfer_config"]["schema"]["x-requires"]["kv_connector"]


def test_a_release_recorded_before_these_keys_is_left_to_the_pod() -> None:
    """0.30-0.32's surface.json predate value_bounds/value_names/dict_options: the rules reading
    them say nothing there (the pod's own vLLM refuses before the engine starts)."""
    cli = rules_for("0.32.0").cli
    assert not cli.value_bounds and not cli.value_names and not cli.dict_options
    assert refusal(["--dp-sync-interval", "0"], V32) is None


def test_a_json_field_that_needs_another_is_refused_as_vllms_validator_refuses_it() -> None:
    """surface.json's `x-requires`, found through vLLM's own TypeAdapter: the parser exits 2."""
    why = refusal(["--profiler-config", '{"torch_profiler_dir": "/tmp/p"}'])
    assert why is not None and "$.torch_profiler_dir needs profiler too" in why, why
    assert refusal(["--profiler-config", '{"torch_profiler_dir": ""}']) is None  # empty: unset to vLLM
