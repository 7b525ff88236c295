"""`vllm.entrypoints.cli.serve`: the serve subcommand and the leaves its `cmd` ends in.

`ServeSubcommand.cmd` picks the leaf vLLM 0.33's does (rankguard_sim.fake_vllm.cli.serve_route)
and calls this module's function of that name, looked up when it runs: the pod's judge replaces
them (agent/rankguard_agent/engine_judge.py). Each leaf runs the fake engine
(rankguard_sim.fake_vllm.main), whose start-up builds its configuration with the same checks
as `vllm.engine.arg_utils` (fake_vllm/config_checks.py); a failed start exits with its status.
"""

import argparse
import asyncio
import os
from typing import Any

from rankguard_sim.fake_vllm import cli
from rankguard_sim.fake_vllm import main as fake
from rankguard_sim.fake_vllm.args import add_serve


class ServeSubcommand:
    """The `serve` subcommand for the vLLM CLI."""

    name = "serve"

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        if getattr(args, "model_tag", None) is not None:
            args.model = args.model_tag  # the positional wins, as in vLLM
        route = cli.serve_route(args)
        if route == cli.RUN_DP_SUPERVISOR:
            run_dp_supervisor(args)
        elif route == cli.RUN_HEADLESS:
            run_headless(args)
        elif route == cli.RUN_MULTI_API_SERVER:
            run_multi_api_server(args)
        else:
            asyncio.run(run_server(args))

    def validate(self, args: argparse.Namespace) -> None:
        """vLLM's validate_parsed_serve_args: the fake plays none of its checks."""

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser:
        return add_serve(subparsers)


def cmd_init() -> list[ServeSubcommand]:
    return [ServeSubcommand()]


def _exit(status: int) -> None:
    if status:
        raise SystemExit(status)


async def run_server(args: argparse.Namespace, **uvicorn_kwargs: Any) -> None:
    """One API server in this process: the fake engine."""
    _exit(await fake.serve(args, os.environ))


def run_headless(args: argparse.Namespace) -> None:
    """No API server (a headless node of a multi-node group): the fake engine."""
    _exit(fake.run_args(args, os.environ))


def run_multi_api_server(args: argparse.Namespace) -> None:
    """Several API servers: the fake plays one process for them all."""
    _exit(fake.run_args(args, os.environ))


def run_dp_supervisor(args: argparse.Namespace) -> None:
    """One server per local data-parallel rank: the fake plays one process for them all."""
    _exit(fake.run_args(args, os.environ))
