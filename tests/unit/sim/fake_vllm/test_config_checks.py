"""The fake vLLM's create_engine_config: what it refuses, as the release it plays, from the
snapshot's config_checks.json (the real ModelConfig's own messages, never typed here)."""

from __future__ import annotations

import pytest

from rankguard_sim.fake_vllm.args import parse_args
from rankguard_sim.fake_vllm.config_checks import (
    SandboxCannotJudge,
    architectures,
    build_config,
    judge_config,
    model_refusal,
)
from rankguard_sim.physics.engine_config import EngineConfigError
from rankguard_sim.physics.scenario_file import SCENARIO_ENV, load_scenario
from rankguard_sim.vllm_snapshot import _config_checks, config_checks, playing

MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
WORLD = {SCENARIO_ENV: "llama3-8b-tp2-24gb"}
RELEASES = ("0.33.0", "0.34.0")


def _recorded(release: str) -> str:
    with playing(release):
        refused = config_checks()["model_runner"]["architectures"]["LlamaForCausalLM"]
    return str(refused["pooling/none"])


@pytest.mark.parametrize("release", RELEASES)
def test_the_record_is_the_real_model_configs_refusal_of_its_own_template(release: str) -> None:
    with playing(release):
        record = config_checks()["model_runner"]
    heads = [s["template"].split("{", 1)[0] for s in record["sources"]]
    assert all(s["file"] == "vllm/config/model.py" and s["line"] > 0 for s in record["sources"])
    message = _recorded(release)
    assert any(message.startswith(h) for h in heads)
    # a generative Llama takes every pair but pooling without a conversion
    assert set(record["architectures"]["LlamaForCausalLM"]) == {"pooling/none"}


@pytest.mark.parametrize("release", RELEASES)
def test_pooling_without_conversion_on_a_generative_llama_is_refused_as_vllm_words_it(release: str) -> None:
    with playing(release):
        scenario = load_scenario(WORLD[SCENARIO_ENV])
        assert architectures(scenario) == ("LlamaForCausalLM",)
        refused = parse_args(["serve", MODEL, "-tp", "2", "--runner", "pooling", "--convert", "none"])
        with pytest.raises(EngineConfigError) as e:
            build_config(refused, WORLD)
        assert str(e.value) == _recorded(release)
        with pytest.raises(ValueError) as judged:  # what the pod's judge sees: vLLM's ValueError
            judge_config(refused, WORLD)
        assert type(judged.value) is ValueError and str(judged.value) == _recorded(release)
        # vLLM converts a generative model for pooling by itself: accepted
        for argv in (["--runner", "pooling"], ["--runner", "pooling", "--convert", "embed"], []):
            built = build_config(parse_args(["serve", MODEL, "-tp", "2", *argv]), WORLD)
            assert built.scenario.name == "llama3-8b-tp2-24gb"
            assert built.engine.tensor_parallel_size == 2


def test_a_release_recorded_without_config_checks_refuses_nothing_of_the_model() -> None:
    assert _config_checks("0.30.0") == {}
    assert model_refusal(["LlamaForCausalLM"], "pooling", "none") is not None  # the played 0.33
    assert model_refusal(["NoSuchArchitectureForCausalLM"], "pooling", "none") is None


def test_what_the_sandbox_cannot_play_is_not_a_refusal() -> None:
    # two built-in worlds serve this model at TP1: the sandbox cannot pick, vLLM did not refuse
    with pytest.raises(SandboxCannotJudge):
        judge_config(parse_args(["serve", MODEL]), {})
    # a multi-node layout vLLM takes but the sandbox does not simulate
    argv = ["serve", MODEL, "--nnodes", "2", "-tp", "2", "--distributed-executor-backend", "uni"]
    with pytest.raises(SandboxCannotJudge):
        judge_config(parse_args(argv), WORLD)
    # vLLM's own multi-node refusal (recorded message) stays a refusal
    with pytest.raises(ValueError) as e:
        judge_config(parse_args(["serve", MODEL, "--nnodes", "3", "-tp", "2"]), WORLD)
    assert type(e.value) is ValueError
