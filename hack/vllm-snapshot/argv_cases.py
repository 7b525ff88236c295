"""The extraArgs case table: what the real `vllm serve` does with a rendered pod's command line.

Runs INSIDE the venv with the real vLLM (see run.sh). For every case (an extraArgs list), the
command a rankguard pod runs is `vllm serve MODEL <base flags> <case>`; this script hands it to
vLLM's own console-script parser (the `vllm` FlexibleArgumentParser with the serve subcommand,
then `ServeSubcommand.validate`), builds vLLM's own `ParallelConfig` from the parsed values (the
world size and the context-parallel rules), and reads what would listen on the port the way
`ServeSubcommand.cmd` and `setup_server` decide it. Nothing is started.

    python argv_cases.py OUT.json

The cases are generated from the parser itself: every spelling of every option with a value
its own type accepts, a value it refuses for every typed option, every JSON (dataclass) option
with good and bad objects built from its dataclass's fields, and the edges of the reader
(prefixes, negative numbers, `-O`). tests/unit/core/engine/test_surface.py holds rankguard's
decision and the fake vLLM's parser against this table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from snapshot import _type_name as _type_doc  # this folder: the one reading of a type callable

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

MODEL = "org/model"
POD_GPUS = 2
# The flags a rendered pod always carries (core/render/deployment.vllm_args), by option dest.
BASE: tuple[tuple[str, str | None], ...] = (
    ("tensor_parallel_size", str(POD_GPUS)),
    ("kv_cache_memory_bytes", str(8 << 30)),
    ("gpu_memory_utilization", "0.9"),
    ("max_num_seqs", "256"),
    ("max_num_batched_tokens", "8192"),
    ("dtype", "auto"),
    ("kv_cache_dtype", "auto"),
    ("host", "0.0.0.0"),
    ("port", "8000"),
)


def _top_parser() -> Any:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers)
    return parser, serve


def _serve_actions(parser: Any) -> list[Any]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices["serve"]._actions)


def _primary(action: Any) -> str:
    longs = [s for s in action.option_strings if s.startswith("--") and not s.startswith("--no-")]
    return min(longs, key=len) if longs else action.option_strings[0]


# --------------------------------------------------------------------------------------------
# Values from an option's own type


def _type_name(t: Any) -> str:
    """The value's type as cli.json records it (snapshot.py's reading of the callable), optional
    unwrapped: int, float, json, human_readable_int, ..., parse_dataclass for a JSON option."""
    doc = _type_doc(t)
    if doc["name"] == "optional":
        doc = doc["of"]
    return "parse_dataclass" if doc.get("callable") == "parse_dataclass" else str(doc["name"])


def good_value(action: Any) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        choice = next(c for c in action.choices if c is not None)
        return [str(choice)]
    d = action.default
    t = _type_name(action.type)
    if t == "parse_dataclass":
        return ["{}"]
    if t == "json":
        return [json.dumps(d)] if isinstance(d, (dict, list)) else ["{}"]
    if t in ("int", "human_readable_int"):
        return [str(d)] if isinstance(d, int) and not isinstance(d, bool) and d > 0 else ["1"]
    if t == "human_readable_int_or_auto":
        return ["auto"]
    if t == "float":
        return [repr(d)] if isinstance(d, float) and d > 0 else ["0.5"]
    if isinstance(d, str) and d:
        return [d]
    if isinstance(d, list) and d and all(isinstance(x, str) for x in d):
        return list(d)
    return ["None"] if "optional" in getattr(action.type, "__name__", "") else ["x"]


def bad_values(action: Any) -> list[list[str]]:
    if action.nargs == 0:
        return []
    t = _type_name(action.type)
    out: list[list[str]] = []
    if t in ("int", "float", "human_readable_int", "human_readable_int_or_auto", "json", "parse_dataclass"):
        out.append(["not-a-value"])
    if action.choices:
        strs = [c for c in action.choices if isinstance(c, str)]
        out.append(["no-such-choice"])
        if strs and strs[0].upper() != strs[0]:
            out.append([strs[0].upper()])
        elif strs and strs[0].lower() != strs[0]:
            out.append([strs[0].lower()])
    return out


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return v is not None


def json_cases(action: Any) -> list[list[str]]:
    """Good and bad objects for a dataclass option, built from its dataclass's fields."""
    from surface import _dataclass_of

    cls = _dataclass_of(action)
    flag = _primary(action)
    cases = [[flag, "{}"], [flag, json.dumps({"no_such_key": 1})], [flag, "LMCache"], [flag, "[]"]]
    fields = [f for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    good = 0
    for f in fields:
        default = f.default
        if default is dataclasses.MISSING or not _jsonable(default):
            continue
        cases.append([flag, json.dumps({f.name: default})])
        if isinstance(default, bool):
            cases.append([flag, json.dumps({f.name: "not-a-bool"})])
        elif isinstance(default, (int, float)):
            cases.append([flag, json.dumps({f.name: "not-a-number"})])
            cases.append([f"{flag}.{f.name}", json.dumps(default)])
        elif isinstance(default, str):
            cases.append([flag, json.dumps({f.name: 12345})])
        good += 1
        if good == 3:
            break
    return cases


def generated_cases(actions: list[Any]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for a in sorted((a for a in actions if a.option_strings), key=lambda a: a.dest):
        if isinstance(a, argparse._HelpAction):
            continue
        value = good_value(a)
        for s in sorted(a.option_strings):
            negative = s.startswith("--no-") or (s.startswith("--disable-") and a.nargs == 0)
            out.append(("spelling", [s] if a.nargs == 0 or negative else [s, *value]))
        for bad in bad_values(a):
            out.append(("bad-value", [_primary(a), *bad]))
        if _type_name(a.type) == "parse_dataclass":
            out += [("json", c) for c in json_cases(a)]
        longest = _primary(a)
        if longest.startswith("--") and len(longest) > 8:
            out.append(("prefix", [longest[:-3], *value] if a.nargs != 0 else [longest[:-3]]))
    return out


# Hand-picked edges (inputs, not vLLM's strings: flags people write, good and bad).
EDGES: tuple[tuple[str, list[str]], ...] = (
    ("help", ["--help"]),
    ("help", ["-h"]),
    ("help", ["--he"]),
    ("help", ["--hel"]),
    ("prefix", ["--head"]),
    ("prefix", ["--enable-pre"]),
    ("prefix", ["-t", "2"]),
    ("prefix", ["-tp2"]),
    ("prefix", ["-tp=2"]),
    ("prefix", ["-as", "1"]),
    ("prefix", ["-pc", "2"]),
    ("prefix", ["-e"]),
    ("negative", ["--seed", "-1"]),
    ("negative", ["--seed", "-0.5"]),
    ("negative", ["--watermark", "-0.5"]),
    ("negative", ["--watermark", "-.5"]),
    ("negative", ["-0.5"]),
    ("negative", ["-1"]),
    ("negative", ["--served-model-name", "a", "-0.5"]),
    ("negative", ["--served-model-name", "-0.5", "--enforce-eager"]),
    ("negative", ["--cudagraph-capture-sizes", "1", "-2", "4"]),
    ("negative", ["--api-key", "-abc"]),
    ("optimization", ["-O3"]),
    ("optimization", ["-O", "3"]),
    ("optimization", ["-O=3"]),
    ("optimization", ["-O", "x"]),
    ("optimization", ["-Ox"]),
    ("optimization", ["-O"]),
    ("optimization", ["-O", "4"]),
    ("optimization", ["--optimization-level", "3"]),
    ("world", ["-pcp", "1"]),
    ("world", ["-pcp", "2"]),
    ("world", ["-dcp", "1"]),
    ("world", ["-dcp", "2"]),
    ("world", ["-dcp", "3"]),
    ("world", ["-dcp", "4"]),
    ("world", ["-pcp", "2", "-dcp", "2"]),
    ("world", ["--distributed-executor-backend", "mp"]),
    ("world", ["--distributed-executor-backend", "ray"]),
    ("world", ["--distributed-executor-backend", "uni"]),
    ("world", ["--distributed-executor-backend", "external_launcher"]),
    ("world", ["--distributed-executor-backend", "no-such-backend"]),
    ("world", ["-dp", "1"]),
    ("world", ["-dp", "2"]),
    ("world", ["-dpl", "1"]),
    ("world", ["--data-parallel-rank", "0"]),
    ("world", ["--data-parallel-start-rank", "0"]),
    ("world", ["--nnodes", "2"]),
    ("world", ["--nnodes", "1"]),
    ("world", ["--node-rank", "1"]),
    ("world", ["--master-addr", "10.0.0.1"]),
    ("world", ["--master-port", "29500"]),
    ("world", ["-ep"]),
    ("world", ["-ep", "--enable-eplb"]),
    ("endpoint", ["--headless"]),
    ("endpoint", ["--api-server-count", "0"]),
    ("endpoint", ["--api-server-count", "1"]),
    ("endpoint", ["--api-server-count", "2"]),
    ("endpoint", ["--headless", "--api-server-count", "1"]),
    ("endpoint", ["--grpc"]),
    ("endpoint", ["--uds", "/tmp/vllm.sock"]),
    ("endpoint", ["--ssl-keyfile", "/etc/tls/tls.key", "--ssl-certfile", "/etc/tls/tls.crt"]),
    ("endpoint", ["--ssl-keyfile", "/etc/tls/tls.key"]),
    ("endpoint", ["--ssl-certfile", "/etc/tls/tls.crt"]),
    ("endpoint", ["--root-path", "/llm"]),
    ("endpoint", ["--api-key", "secret"]),
    ("memory", ["--cpu-offload-gb", "4"]),
    ("memory", ["--cpu-offload-gb", "0"]),
    ("memory", ["--kv-offloading-size", "8"]),
    ("memory", ["--kv-offloading-size", "8", "--kv-offloading-backend", "native"]),
    ("memory", ["--enable-lora"]),
    ("memory", ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]),
    ("memory", ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']),
    ("memory", ["--mm-processor-cache-gb", "0"]),
    ("json", ["--compilation-config", '{"level": 3}']),
    ("json", ["--compilation-config", '{"mode": 3}']),
    ("json", ["--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4, 8]}']),
    ("json", ["--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}']),
    ("json", ["--compilation-config", '{"cudagraph_mode": "NOT_A_MODE"}']),
    ("json", ["-cc.mode=3"]),
    ("json", ["-cc.cudagraph_capture_sizes+", "1,2,4"]),
    ("json", ["--kv-transfer-config", "LMCache"]),
    ("json", ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}']),
    ("json", ["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_everything"}']),
    ("json", ["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq"}']),
    ("json", ["--structured-outputs-config", '{"backend": "xgrammar"}']),
    ("json", ["--structured-outputs-config", '{"backend": "outlines2"}']),
    ("json", ["--attention-config", '{"backend": "FLASH_ATTN"}']),
    ("json", ["--attention-config", '{"flash_attn_version": 3}']),
    ("json", ["--attention-config", '{"flash_attn_version": "three"}']),
    ("json", ["--compilation-config", '{"max_cudagraph_capture_size": 4k}']),
    ("item", ["--max-num-seqs 64"]),
    ("item", ["--enforce-eager "]),
    ("item", ["64"]),
    ("item", ["--served-model-name=llama3"]),
    ("item", ["--served_model_name", "llama3"]),
    ("item", ["--enable-auto-tool-choice"]),
    ("item", ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]),
    ("item", ["--enable-log-outputs"]),
    ("item", ["--sse-keep-alive-interval", "-1"]),
    ("item", ["--config", "/etc/vllm/config.yaml"]),
    ("item", ["--no-such-flag"]),
    ("item", ["--max-model-len", "32k"]),
)


# --------------------------------------------------------------------------------------------
# What vLLM does with one command line


_ADDRESS = re.compile(r" at 0x[0-9a-f]+>")


def _last_line(text: str) -> str:
    """The line of an error that says what is wrong (object addresses removed: the table must be
    the same bytes on every run)."""
    text = _ADDRESS.sub(">", text)
    lines = [
        line
        for line in text.strip().splitlines()
        if line.strip() and not line.strip().startswith("For further information visit")
    ]
    return lines[-1][:400] if lines else ""


def _parallel(args: Any) -> tuple[int | None, str | None]:
    from vllm.config import ParallelConfig

    fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    # what the command line set, as EngineArgs hands it on (an unset option: the config's default)
    kwargs = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            config = ParallelConfig(**kwargs)
    except Exception as e:  # vLLM's own refusal (pydantic ValidationError or ValueError)
        errors = getattr(e, "errors", None)
        if callable(errors):
            return None, "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in errors())[:400]
        return None, _last_line(str(e)) or type(e).__name__
    return int(config.world_size), None


def _local_dp(args: Any) -> int:
    """Data-parallel engines on this node: the GPUs it needs are world size × this."""
    if args.data_parallel_size_local is not None:
        return int(args.data_parallel_size_local)
    if args.data_parallel_external_lb or args.data_parallel_rank is not None:
        return 1
    return int(args.data_parallel_size)


def _endpoint(args: Any) -> str:
    """What listens on the pod's port, the way `ServeSubcommand.cmd` and `setup_server` decide."""
    if getattr(args, "grpc", False):
        return "grpc"
    if args.headless or (args.api_server_count is not None and args.api_server_count < 1):
        return "none"
    if args.uds:
        return "uds"
    if args.ssl_keyfile and args.ssl_certfile:
        return "https"
    return "http"


def evaluate(parser: Any, serve: Any, argv: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    err, std = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
            args = parser.parse_args(argv)
    except SystemExit as e:
        out["parse"] = f"exit{e.code}"
        out["message"] = _last_line(err.getvalue()) if e.code else "printed help and exited"
        out["starts"] = False
        return out
    except Exception as e:  # vLLM's parser crashed (a traceback, exit 1)
        out["parse"] = "crash"
        out["message"] = f"{type(e).__name__}: {_last_line(str(e))}"
        out["starts"] = False
        return out
    out["parse"] = "ok"
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            serve.validate(args)
    except Exception as e:
        out["validate"] = f"{type(e).__name__}: {_last_line(str(e))}"
        out["starts"] = False
        return out
    world, why = _parallel(args)
    out["world_size"] = world
    if why is not None:
        out["parallel_error"] = why
    out["endpoint"] = _endpoint(args)
    gpus = None if world is None else world * _local_dp(args)
    out["gpus_needed"] = gpus
    launcher = args.distributed_executor_backend == "external_launcher"
    multinode = args.nnodes > 1
    out["starts"] = (
        why is None and gpus == POD_GPUS and out["endpoint"] == "http" and not launcher and not multinode
    )
    if launcher:
        out["message"] = "external_launcher: every rank is a process a launcher (torchrun) starts"
    elif multinode:
        out["message"] = f"nnodes={args.nnodes}: the engine waits for the other nodes to join"
    return out


def main() -> None:
    import vllm  # noqa: F401  (the package must import)

    dest = Path(sys.argv[1])
    parser, serve = _top_parser()
    actions = _serve_actions(parser)
    by_dest = {a.dest: a for a in actions if a.option_strings}
    base: list[str] = []
    for d, value in BASE:
        base += [_primary(by_dest[d])] + ([] if value is None else [value])
    seen: set[str] = set()
    rows = []
    for group, case in [*generated_cases(actions), *EDGES]:
        key = json.dumps(case)
        if key in seen:
            continue
        seen.add(key)
        real = evaluate(parser, serve, ["serve", MODEL, *base, *case])
        rows.append({"group": group, "extra_args": case, "real": real})
    import importlib.metadata

    doc = {
        "vllm_version": importlib.metadata.version("vllm"),
        "generated_by": "hack/vllm-snapshot/run.sh " + importlib.metadata.version("vllm"),
        "model": MODEL,
        "pod_gpus": POD_GPUS,
        "base_args": base,
        "cases": rows,
    }
    dest.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {dest}: {len(rows)} cases")


if __name__ == "__main__":
    main()
