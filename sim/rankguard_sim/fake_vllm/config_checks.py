"""What the fake vLLM refuses when it builds its configuration (vLLM's `create_engine_config`).

One function, `build_config`, runs the checks the fake plays, in vLLM's order: the multi-node
flags' refusals (multinode.py, recorded messages), the scenario the flags serve (the sandbox's
world), the model's own checks (`model_refusal`: what vLLM's `ModelConfig` refuses for this
model's architecture, recorded from the real package in config_checks.json, see
hack/vllm-snapshot/config_checks.py), then the flags the world models (args.config_from_args).
The fake's start-up (main.py) and its `vllm` package's `create_engine_config` (the pod's judge,
agent/rankguard_agent/engine_judge.py) both run it, so the sandbox's engine judges its argv as
the release it plays does. A release recorded without config_checks.json refuses nothing of
the model's: the fake accepts it.

`judge_config` is what the stand-in `vllm.engine.arg_utils` runs: a refusal is a ValueError
with vLLM's text (as vLLM raises it, so the judge says "refused"); what the sandbox cannot play
(no scenario for the model, a multi-node layout it does not simulate, engine_config's
UnsimulatedConfig: flags vLLM builds but the world has no measurements for) is a RuntimeError, which
the judge reports as "unjudged", and the fake's start-up then fails as it always has.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rankguard_sim.fake_vllm.args import config_from_args
from rankguard_sim.fake_vllm.multinode import sandbox_refusal, vllm_refusal
from rankguard_sim.physics.engine_config import EngineConfig, EngineConfigError, UnsimulatedConfig
from rankguard_sim.physics.scenario_data import Scenario, ScenarioError
from rankguard_sim.physics.scenario_file import SCENARIO_ENV, find_scenario, load_scenario
from rankguard_sim.vllm_snapshot import config_checks


class SandboxCannotJudge(RuntimeError):
    """The sandbox cannot play these flags (its own limit, not vLLM's refusal)."""


@dataclass(frozen=True)
class FakeVllmConfig:
    """What the fake's `create_engine_config` returns: the world it serves and the engine's sizes."""

    scenario: Scenario
    engine: EngineConfig


def architectures(scenario: Scenario) -> tuple[str, ...]:
    """The model's config.json `architectures` (its model_config when the scenario gives one)."""
    config = scenario.model_config
    if config is not None:
        found = config.get("architectures")
        if isinstance(found, list) and all(isinstance(a, str) for a in found):
            return tuple(found)
    return scenario.model.architectures


def model_refusal(archs: Sequence[str], runner: str, convert: str) -> str | None:
    """vLLM's ModelConfig refusal of `--runner runner --convert convert` for this model (the
    recorded message), None when the release takes it or the record has no such architecture."""
    recorded = config_checks().get("model_runner", {}).get("architectures", {})
    for arch in archs:
        refused = recorded.get(arch, {}).get(f"{runner}/{convert}")
        if refused:
            return str(refused)
    return None


def find_world(args: argparse.Namespace, env: Mapping[str, str]) -> Scenario:
    """The scenario these flags serve: RANKGUARD_SIM_SCENARIO's, else the built-in for the model."""
    name = env.get(SCENARIO_ENV)
    if name:
        return load_scenario(name)
    tag = args.model_tag if args.model_tag is not None else args.model
    return find_scenario(tag, args.tensor_parallel_size, args.pipeline_parallel_size, args.nnodes)


def build_config(args: argparse.Namespace, env: Mapping[str, str]) -> FakeVllmConfig:
    """The fake engine's configuration for parsed flags; raises EngineConfigError with vLLM's
    refusal, ScenarioError when the sandbox has no world for them."""
    refused = vllm_refusal(args)
    if refused is not None:
        raise EngineConfigError(refused)
    scenario = find_world(args, env)
    refused = model_refusal(
        architectures(scenario), str(getattr(args, "runner", "auto")), str(getattr(args, "convert", "auto"))
    )
    if refused is not None:
        raise EngineConfigError(refused)
    return FakeVllmConfig(scenario, config_from_args(scenario, args))


def judge_config(args: argparse.Namespace, env: Mapping[str, str]) -> FakeVllmConfig:
    """`build_config` as vLLM's create_engine_config raises: ValueError for a refusal,
    SandboxCannotJudge (a RuntimeError) for what the sandbox does not play."""
    refused = vllm_refusal(args)
    if refused is not None:
        raise ValueError(refused)
    limit = sandbox_refusal(args)
    if limit is not None:
        raise SandboxCannotJudge(limit)
    try:
        return build_config(args, env)
    except (ScenarioError, UnsimulatedConfig) as e:
        raise SandboxCannotJudge(str(e)) from e
    except EngineConfigError as e:
        raise ValueError(str(e)) from None
