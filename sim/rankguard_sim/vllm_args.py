"""vLLM's command line for the fake `vllm serve`: the flags it accepts and the EngineConfig they give.

Kept apart from the server so that anything holding a rendered `vllm serve ...` argv (the
benchmark, tests) resolves it exactly as the fake vLLM does, without starting a process.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rankguard_sim.engine_config import BLOCK_SIZES, DTYPES, KV_CACHE_DTYPES, EngineConfig, engine_config
from rankguard_sim.scenario_data import Scenario

VLLM_VERSION = "0.11.0"


def human_readable_int(value: str) -> int:
    """vLLM's size syntax: 1k = 1000, 1K = 1024 (likewise m/M, g/G, t/T); plain integers too."""
    text = value.strip().replace("_", "")
    units = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
    if text and text[-1] in "kmgt":
        return round(float(text[:-1]) * units[text[-1]])
    if text and text[-1] in "KMGT":
        return int(text[:-1]) * int(1024 ** ("KMGT".index(text[-1]) + 1))
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM CLI (simulated by rankguard_sim)")
    parser.add_argument("-v", "--version", action="version", version=VLLM_VERSION)
    sub = parser.add_subparsers(dest="subparser", required=True)
    serve = sub.add_parser("serve", help="Start the vLLM OpenAI Compatible API server.")
    serve.add_argument("model_tag", help="The model tag to serve")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", nargs="+", default=None)
    serve.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    serve.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    serve.add_argument("--gpu-memory-utilization", type=float, default=None)
    serve.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=None)
    serve.add_argument("--max-model-len", type=human_readable_int, default=None)
    serve.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    serve.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=None)
    serve.add_argument("--dtype", choices=DTYPES, default="auto")
    serve.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    serve.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    serve.add_argument("--disable-custom-all-reduce", action="store_true")
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    serve.add_argument("--trust-remote-code", action="store_true")
    serve.add_argument("--seed", type=int, default=None)
    serve.add_argument("--disable-log-stats", action="store_true")
    serve.add_argument(
        "--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    return parser


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's FlexibleArgumentParser accepts --max_model_len as well as --max-model-len."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            key, eq, value = arg.partition("=")
            out.append(key.replace("_", "-") + eq + value)
        else:
            out.append(arg)
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like vLLM: argparse's own errors (unknown flag, bad value) exit with status 2."""
    return build_parser().parse_args(normalize_argv(argv))


NON_DEFAULT_KEYS = (
    "model_tag",
    "host",
    "port",
    "served_model_name",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "max_model_len",
    "max_num_batched_tokens",
    "block_size",
    "dtype",
    "kv_cache_dtype",
    "enforce_eager",
    "disable_custom_all_reduce",
)


def non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    defaults = vars(build_parser().parse_args(["serve", "x"]))
    return {
        k: getattr(args, k) for k in NON_DEFAULT_KEYS if k == "model_tag" or getattr(args, k) != defaults[k]
    }


def config_from_args(
    scenario: Scenario, args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> EngineConfig:
    """The EngineConfig parsed flags give on this scenario (raises EngineConfigError as vLLM refuses).

    `env` is read for VLLM_ALLOW_LONG_MAX_MODEL_LEN only; None means this process's environment,
    which is what the fake vLLM uses.
    """
    env = os.environ if env is None else env
    return engine_config(
        scenario,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=bool(args.enforce_eager),
        disable_custom_all_reduce=args.disable_custom_all_reduce,
        allow_long_max_model_len=env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "") in ("1", "true", "True"),
    )


def engine_config_from_argv(
    scenario: Scenario, argv: Sequence[str], env: Mapping[str, str] | None = None
) -> EngineConfig:
    """The EngineConfig a `vllm serve ...` argv (without the `vllm` itself) gives on this scenario.

    The same parse and resolution the fake vLLM runs: a bad command line exits 2 (SystemExit,
    as argparse does) and flags vLLM would refuse raise EngineConfigError. `parse_args(argv)`
    gives the namespace alone.
    """
    return config_from_args(scenario, parse_args(argv), env)
