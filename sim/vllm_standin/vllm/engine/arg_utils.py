"""`vllm.engine.arg_utils`: the engine's arguments and the configuration they build.

`create_engine_config` runs the fake's config checks (rankguard_sim.fake_vllm.config_checks):
vLLM's refusals, recorded from the release the fake plays, raise ValueError as vLLM's do; what
the sandbox cannot play raises RuntimeError. Nothing starts: it only judges and sizes.
"""

import argparse
import os
from typing import Any

from rankguard_sim.fake_vllm.config_checks import FakeVllmConfig, judge_config


class EngineArgs:
    """The parsed `vllm serve` flags, by name (vLLM's dataclass holds one field per flag)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.__dict__.update(vars(args))
        self._args = args

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(args)

    def create_engine_config(self, usage_context: Any = None, headless: bool = False) -> FakeVllmConfig:
        return judge_config(self._args, os.environ)


class AsyncEngineArgs(EngineArgs):
    """The API server's engine arguments."""
