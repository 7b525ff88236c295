"""Command line: `python -m rankguard_agent launch|serve|probe …` (see docs/agent.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace

from rankguard_agent import __version__
from rankguard_agent.constants import DEFAULT_HOST, DEFAULT_PORT, DEFAULT_TERMINATION_LOG
from rankguard_agent.gpu import BACKENDS
from rankguard_agent.judge_run import DEFAULT_JUDGE_TIMEOUT
from rankguard_agent.launcher import LaunchConfig, launch
from rankguard_agent.probe import ProbeConfig, model_shape_from_config, run_probe
from rankguard_agent.runtime import AgentRuntime, RuntimeConfig, open_backend_or_none
from rankguard_agent.sampler import DEFAULT_HZ, DEFAULT_WINDOW_SECONDS

log = logging.getLogger("rankguard_agent")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds (0 or more)")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port")
    return value


def _runtime_args(p: argparse.ArgumentParser, backend_choices: Sequence[str]) -> None:
    p.add_argument(
        "--backend",
        choices=backend_choices,
        default="auto",
        help="GPU readings: nvml, sim (the sandbox's files), auto = sim when "
        "RANKGUARD_SIM_GPU_ROOT is set, else nvml",
    )
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to serve on (default {DEFAULT_HOST})")
    p.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help=f"port to serve on (default {DEFAULT_PORT}; 0 = any)"
    )
    p.add_argument(
        "--window",
        type=_positive,
        default=DEFAULT_WINDOW_SECONDS,
        help=f"seconds over which min free memory is kept (default {DEFAULT_WINDOW_SECONDS:g})",
    )
    p.add_argument(
        "--hz",
        type=_positive,
        default=DEFAULT_HZ,
        help=f"samples per second per rank (default {DEFAULT_HZ:g})",
    )


def _probe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("probe")
    g.add_argument(
        "--probe-world-size", type=int, default=0, help="ranks to probe (default: every visible GPU)"
    )
    g.add_argument("--probe-device", choices=("auto", "cuda", "cpu"), default="auto")
    g.add_argument("--probe-model-config", help="a model's config.json: hidden_size and vocab_size")
    g.add_argument("--probe-hidden-size", type=int, default=4096)
    g.add_argument("--probe-vocab-size", type=int, default=32000)
    g.add_argument("--probe-tokens", type=int, default=512, help="rows of the warm-up all-reduce")
    g.add_argument("--probe-batch", type=int, default=256, help="rows of the warm-up logits all-gather")
    g.add_argument("--probe-timeout", type=_positive, default=300.0, help="seconds for the whole probe")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rankguard_agent", description="rankguard's GPU-side agent"
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    launch = sub.add_parser("launch", help="run an engine under the agent: launch [options] -- COMMAND...")
    _runtime_args(launch, BACKENDS)
    launch.add_argument(
        "--termination-log",
        default=DEFAULT_TERMINATION_LOG,
        help=f"where the termination message goes (default {DEFAULT_TERMINATION_LOG})",
    )
    launch.add_argument("--probe", action="store_true", help="probe every rank's communicator cost first")
    launch.add_argument(
        "--judge-timeout",
        type=_non_negative,
        default=DEFAULT_JUDGE_TIMEOUT,
        help="seconds the image's own vLLM may take to judge the engine's arguments before the "
        f"engine starts (default {DEFAULT_JUDGE_TIMEOUT:g}; past it the engine starts unjudged; "
        "0 = never judge)",
    )
    _probe_args(launch)
    serve = sub.add_parser("serve", help="sampler and HTTP API only, until SIGTERM")
    _runtime_args(serve, BACKENDS)
    probe = sub.add_parser("probe", help="run the probe once and print its result as JSON")
    probe.add_argument("--backend", choices=BACKENDS, default="auto", help="where free memory is read")
    _probe_args(probe)
    return parser


def _probe_config(args: argparse.Namespace, backend: str) -> ProbeConfig:
    hidden, vocab = args.probe_hidden_size, args.probe_vocab_size
    if args.probe_model_config:
        hidden, vocab = model_shape_from_config(args.probe_model_config)
    return ProbeConfig(
        world_size=args.probe_world_size,
        device=args.probe_device,
        hidden_size=hidden,
        vocab_size=vocab,
        tokens=args.probe_tokens,
        batch=args.probe_batch,
        timeout_s=args.probe_timeout,
        gpu_backend=backend,
    )


def _runtime_config(args: argparse.Namespace) -> RuntimeConfig:
    return RuntimeConfig(
        backend=args.backend, host=args.host, port=args.port, window_seconds=args.window, hz=args.hz
    )


async def serve(cfg: RuntimeConfig) -> int:
    """Sampler and server until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runtime = AgentRuntime(cfg, os.environ)
    try:
        await runtime.start()
        if not runtime.serving:
            return 1  # serving is all this command does
        await stop.wait()
        return 0
    finally:
        await runtime.stop()


def _setup_logging() -> None:
    level = os.environ.get("RANKGUARD_AGENT_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level, logging.INFO),
        format="rankguard-agent %(levelname)s %(name)s: %(message)s",
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = build_parser().parse_args(argv)
    _setup_logging()
    if args.cmd == "serve":
        if command:
            build_parser().error("serve takes no command; did you mean launch?")
        return asyncio.run(serve(_runtime_config(args)))
    if args.cmd == "probe":
        cfg = _probe_config(args, args.backend)
        if cfg.world_size == 0:
            backend, _ = open_backend_or_none(args.backend, os.environ)
            cfg = replace(cfg, world_size=max(1, len(backend.ranks())))
            backend.close()
        result = run_probe(cfg)
        print(json.dumps(asdict(result)))
        return 0 if result.ok else 1
    if not command:
        build_parser().error("launch needs a command after --, e.g. launch -- vllm serve MODEL")
    cfg_l = LaunchConfig(
        command=command,
        runtime=_runtime_config(args),
        termination_log=args.termination_log,
        probe=_probe_config(args, args.backend) if args.probe else None,
        judge_timeout=args.judge_timeout,
    )
    return asyncio.run(launch(cfg_l))


if __name__ == "__main__":
    sys.exit(main())
