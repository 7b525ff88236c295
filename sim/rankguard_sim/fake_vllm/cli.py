"""The `vllm` command of the sandbox's stand-in `vllm` package (sim/vllm_standin/vllm), as vLLM's
own vllm/entrypoints/cli/main.py and serve.py run it: what the stand-in modules delegate to.

`main(cmd_init)` is vLLM's `main()`: the top parser, each subcommand's `subparser_init` with
`dispatch_function=cmd.cmd`, FlexibleArgumentParser's argv preprocessing (args.normalize_argv),
`cmd.validate`, then the dispatch. `serve_route(args)` is the leaf vLLM 0.33's
`ServeSubcommand.cmd` ends in for these flags (run_server, run_headless, run_multi_api_server,
run_dp_supervisor), with the `api_server_count` it sets; the stand-in's `cmd` calls that leaf of
its own module, so the pod's judge (agent/rankguard_agent/engine_judge.py), which replaces the
leaves, stops where it stops in the real vLLM. The fake does not play the refusals `cmd` itself
raises (--headless with --api-server-count, two data-parallel load-balancing modes): unrecorded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rankguard_sim.fake_vllm.args import normalize_argv, top_parser

RUN_SERVER = "run_server"
RUN_HEADLESS = "run_headless"
RUN_MULTI_API_SERVER = "run_multi_api_server"
RUN_DP_SUPERVISOR = "run_dp_supervisor"


class Subcommand(Protocol):
    name: str

    def cmd(self, args: argparse.Namespace) -> None: ...

    def validate(self, args: argparse.Namespace) -> None: ...

    def subparser_init(self, subparsers: Any) -> argparse.ArgumentParser: ...


def main(cmd_init: Callable[[], Sequence[Subcommand]], argv: Sequence[str] | None = None) -> None:
    """vLLM's `vllm` main: parse, validate, dispatch (no subcommand: print the help)."""
    parser, subparsers = top_parser(required=False)
    cmds: dict[str, Subcommand] = {}
    for cmd in cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
        cmds[cmd.name] = cmd
    args = parser.parse_args(normalize_argv(sys.argv[1:] if argv is None else argv))
    if args.subparser in cmds:
        cmds[args.subparser].validate(args)
    if hasattr(args, "dispatch_function"):
        args.dispatch_function(args)
    else:
        parser.print_help()


def serve_route(args: argparse.Namespace) -> str:
    """The serve leaf vLLM 0.33's `ServeSubcommand.cmd` calls, setting `api_server_count` as it does."""
    if args.headless:
        args.api_server_count = 0  # headless: no API server
    external_lb = bool(getattr(args, "data_parallel_external_lb", False)) or (
        getattr(args, "data_parallel_rank", None) is not None
    )
    hybrid = bool(getattr(args, "data_parallel_hybrid_lb", False))
    multi_port = bool(getattr(args, "data_parallel_multi_port_external_lb", False))
    if not hybrid and not multi_port:
        hybrid = getattr(args, "data_parallel_start_rank", None) is not None
    if args.api_server_count is None:
        if multi_port or external_lb:
            args.api_server_count = 1
        elif hybrid:
            args.api_server_count = getattr(args, "data_parallel_size_local", None) or 1
        else:
            args.api_server_count = args.data_parallel_size
    if multi_port:
        return RUN_DP_SUPERVISOR
    if args.api_server_count < 1:
        return RUN_HEADLESS
    if args.api_server_count > 1:
        return RUN_MULTI_API_SERVER
    args.api_server_count = None  # a single API server: this process
    return RUN_SERVER
