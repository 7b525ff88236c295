"""Write a snapshot of one installed vLLM: its `vllm serve` options, the lines rankguard reads, KV facts.

Runs INSIDE a venv that has the real `vllm` installed (see run.sh, which makes that venv);
nothing here is typed from memory: options come from vLLM's own parser object, format strings
from the installed source (file:line) and from torch's shared libraries, the KV facts from the
config classes and the source line that proves them. If a fact cannot be found the script stops
with the name of what is missing, so a new vLLM version is re-read, never guessed. An older
release may lack a message the recognisers know, a newer one may have removed it: only the keys
releases.py lists for it (each checked in its source) are recorded as `absent`, with the reason.
The CPU build: cpu_build.py; the extensible KV cache's facts (0.34 on): extensible.py.

    python snapshot.py OUT_DIR

writes OUT_DIR/{cli,formats,engine,surface,config_checks}.json (sorted keys, stable order: a re-run
on the same version gives the same bytes). config_checks.json (config_checks.py): the refusals
vLLM makes when it builds a model's configuration, which the sandbox's fake vLLM judges with.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from config_checks import config_checks  # this folder (on sys.path)
from cpu_build import is_cpu_build, py_messages, release_meta
from extensible import extensible_facts
from releases import expected_absent
from surface import surface_snapshot
from templates import composed_messages, literals, template

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# The lines rankguard's agent recognises. Key: our name for the line; value: (package, a
# fragment that occurs in exactly the message(s) we mean). The fragments are search keys, not
# the messages: the messages themselves are copied out of the installed source below.
PY_MESSAGES: dict[str, tuple[str, str]] = {
    "kv_cache_size": ("vllm", "KV cache size: %s tokens"),
    "available_kv_memory": ("vllm", "Available KV cache memory"),
    "model_loading": ("vllm", "Model loading took"),
    "startup_free_too_low": ("vllm", "is less than desired GPU memory utilization"),
    "startup_free_external": ("vllm", "is less than the engine's budget after excluding"),
    "startup_external_weights": ("vllm", "Externally held weights on device"),
    "worker_memory_report": ("vllm", "Replace gpu_memory_utilization config with"),
    "cuda_graph_pool": ("vllm", "CUDA graph pool memory"),
    "kv_bytes_reserved": ("vllm", "memory for KV Cache as specified by kv_cache_memory_bytes"),
    "kv_too_small": ("vllm", "KV cache is needed, which is larger than the available KV cache memory"),
    "no_kv_memory": ("vllm", "No available memory for the cache blocks"),
    # not recognised by the agent: the sandbox's fake vLLM prints it when it "downloads" weights
    "weights_download_time": ("vllm", "Time spent downloading weights for"),
    # not recognised by the agent: vLLM's multi-node (`--nnodes`, mp backend) refusals and lines,
    # which the sandbox's fake vLLM prints (fake_vllm/rendezvous.py)
    "nnodes_backend": ("vllm", "requires `--data-parallel-backend mp`; got"),
    "nnodes_world_size": ("vllm", "must evenly divide the total world size"),
    "node_rank_range": ("vllm", "`--node-rank` must be between 0 and"),
    "nnodes_executor_backend": ("vllm", "nnodes > 1 can only be set when distributed executor backend"),
    "headless_launch": ("vllm", "headless multiproc executor, with head node address"),
    "dp_group_leader": ("vllm", "DP group leader: node_rank="),
    "worker_init_failed": ("vllm", "WorkerProc initialization failed due to an exception in a background"),
    "broadcast_wait": ("vllm", "No available shared memory broadcast block found in"),
    "rpc_timed_out": ("vllm", "RPC call to {0} timed out."),
    # The engine's phase markers (agent/rankguard_agent/wire/phases.py): the lines vLLM prints as a
    # start-up phase begins or ends, in the order it runs them. Weights: the model runner starts
    # loading (V1 runner, V2 runner); `model_loading` ends it. The memory profile's CUDA-graph
    # capture starts and ends; `available_kv_memory` / `kv_bytes_reserved` end the profile (the
    # KV cache is allocated next) and the engine core's `kv_cache_size` says the same for every
    # rank. The capture proper starts (its progress bar, or the profiler line); it ends with
    # "Graph capturing finished" (the sampler warm-up follows). The engine core's "init engine"
    # line and the API server's start mean serving.
    # vLLM 0.34's extensible KV cache (vllm/v1/worker/extensible_kv_cache.py, where the V1 runner
    # is gone): `available_kv_memory` ends the profile and the KV address range is reserved; the
    # warm-up and capture run (the V2 runner's progress bar, `cuda_graph_capture_bar`, then
    # `cuda_graph_captured`); every rank measures what is left ("Memory after warmup", which ends
    # the measurement and may follow the utilisation warning); the engine core takes the minimum
    # (`kv_cache_size`, now printed after warm-up) and the workers commit it ("Extended KV cache
    # to"); "init engine" means serving. The executor's "Disabling the extensible KV cache" says
    # it fell back to the estimate (a driver without VMM).
    "memory_after_warmup": ("vllm", "Memory after warmup: "),
    "utilization_withholds": ("vllm", " caps this instance at "),
    "extensible_kv_disabled": ("vllm", "Disabling the extensible KV cache: "),
    "extensible_kv_extended": ("vllm", "Extended KV cache to "),
    "model_load_start": ("vllm", "Starting to load model"),
    "model_load_start_v2": ("vllm", "Loading model from scratch"),
    "cuda_graph_profiling": ("vllm", "Profiling CUDA graph memory: "),
    "cuda_graph_estimated": ("vllm", "Estimated CUDA graph memory: "),
    "cuda_graph_capture_bar": ("vllm", "Capturing CUDA graphs ("),
    "cuda_graph_capture_untraced": ("vllm", "Torch profiler disabled for CUDA graph capture"),
    "cuda_graph_capture_traced": ("vllm", "Torch profiler enabled for CUDA graph capture"),
    "cuda_graph_captured": ("vllm", "Graph capturing finished in "),
    "init_engine_took": ("vllm", "init engine (profile, create kv cache, warmup model) took"),
    "api_server_start": ("vllm", "Starting vLLM server on "),
}
# A file is read when its source holds a key's fragment, or this anchor where the fragment spans
# adjacent literals (or an f-string's expression) in the source: the fragment itself is matched
# against the template the literals make.
PY_MESSAGE_ANCHORS: dict[str, str] = {
    "nnodes_backend": "`--data-parallel-backend mp`; got ",
    "nnodes_world_size": "must evenly divide the total ",
    "node_rank_range": "`--node-rank` must ",
    "nnodes_executor_backend": "nnodes > 1 can only be set when distributed executor ",
    "headless_launch": "headless multiproc executor, ",
    "worker_init_failed": "WorkerProc initialization failed due to an exception in a ",
    "broadcast_wait": "No available shared memory broadcast block found ",
    "rpc_timed_out": "RPC call to {method} timed out.",
}
# A key no literal holds in a release may be composed: an f-string that starts with a parameter
# whose default is a string literal, the default completing it (vLLM 0.34's capture bar is
# `tqdm(descs, desc=f"{progress_bar_desc} ({mode.name})")`, progress_bar_desc defaulting to
# "Capturing CUDA graphs"). Looked for only where the release has no literal, so that a release
# with one (0.33's V1 runner) records the literal alone.
PY_MESSAGE_DEFAULTS: dict[str, str] = {"cuda_graph_capture_bar": "progress_bar_desc"}
# PyTorch's allocator messages are C++ (c10/cuda); they are read from the shared libraries.
LIB_MESSAGES: dict[str, tuple[str, str]] = {
    "torch_oom_tried": ("libc10_cuda.so", "CUDA out of memory. Tried to allocate "),
    "torch_oom_capacity": ("libc10_cuda.so", " has a total capacity of "),
    "torch_oom_fraction": ("libc10_cuda.so", "Allocation was preemptively rejected"),
    "torch_oom_private_pools": ("libc10_cuda.so", " allocated in private pools"),
    "torch_oom_outside_allocator": ("libtorch_cuda.so", "CUDA ran out of memory outside PyTorch's allocator"),
    "cublas_alloc_failed": ("libtorch_cuda.so", "CUBLAS_STATUS_ALLOC_FAILED"),
    # the cudaMallocAsync backend's refusal ("Allocation on device 0 would exceed allowed memory.
    # (out of memory)"), and the native allocator's with expandable segments or
    # throw_on_cudamalloc_oom ("... failed with OOM on device N")
    "torch_oom_async": ("libc10_cuda.so", " would exceed allowed memory. (out of memory)"),
    "torch_oom_on_device": ("libc10_cuda.so", " failed with OOM on device "),
}
# torch.distributed's fmt::format templates (C++), recorded whole: `{}` is str.format's too.
LIB_FORMATS: dict[str, tuple[str, str]] = {
    "store_clients_timeout": ("libtorch_cpu.so", "seconds waiting for clients. {}/{} clients joined."),
    "client_connect_timeout": ("libtorch_cpu.so", "while trying to connect to ({}, {})."),
}
# Keys a release may lack, with the reason checked in its source (older releases: messages that
# came later; newer ones: messages whose code they removed): releases.py.
# The source line that proves the block pool holds one block back (the "null block").
NULL_BLOCK_EVIDENCE = ("vllm/v1/core/block_pool.py", "self.null_block = self.free_block_queue.popleft()")
# The download-time line is logged only above a threshold: `if time_taken > X:` around it.
DOWNLOAD_LOG_SOURCE = "vllm/model_executor/model_loader/weight_utils.py"


# --------------------------------------------------------------------------------------------
# The CLI


def _type_name(t: Any) -> dict[str, Any]:
    """A small, closed description of an argparse `type` callable."""
    if t is None:
        return {"name": "str"}
    if t in (int, float, str):
        return {"name": t.__name__}
    name = getattr(t, "__name__", type(t).__name__)
    cells = (
        dict(zip(t.__code__.co_freevars, t.__closure__ or (), strict=True)) if hasattr(t, "__code__") else {}
    )
    if name in ("_optional_type", "_parse_type") and "return_type" in cells:
        inner = _type_name(cells["return_type"].cell_contents)
        return {"name": "optional", "of": inner} if name == "_optional_type" else inner
    if name in ("human_readable_int", "human_readable_int_or_auto"):
        return {"name": name}
    if name == "loads":
        return {"name": "json"}
    if name == "union_dict_and_str":
        return {"name": "str"}  # a JSON object or any string
    if name == "<lambda>":
        try:
            if t("AbC") == "abc":
                return {"name": "lower"}  # `lambda s: s.lower()`: AITER is aiter to vLLM
        except Exception:
            pass
    return {"name": "opaque", "callable": name}  # validated by vLLM only


def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v)
    except TypeError:
        return repr(v)
    return v


def serve_parser() -> Any:
    """`vllm serve`'s own parser object, as the console script builds it."""
    # the `make_arg_parser` the serve subcommand itself calls (its module moved between releases)
    from vllm.entrypoints.cli.serve import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def cli_snapshot() -> dict[str, Any]:
    from vllm.utils import argparse_utils

    # vLLM's `--enable-x`/`--disable-x` switch; a release without it has argparse's `--no-x` alone
    enable_disable = getattr(argparse_utils, "EnableDisableAction", argparse.BooleanOptionalAction)
    parser = serve_parser()
    # every registered spelling, hidden ones included (`--no-enable-x`)
    spellings: dict[int, list[str]] = {}
    for opt, action in parser._option_string_actions.items():
        spellings.setdefault(id(action), []).append(opt)
    options = []
    positionals = []
    for action in parser._actions:
        if not action.option_strings:
            positionals.append({"dest": action.dest, "nargs": action.nargs})
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        kind = {
            argparse._StoreAction: "value",
            argparse._AppendAction: "append",
            argparse._StoreTrueAction: "true",
            argparse._StoreFalseAction: "false",
            enable_disable: "switch",
            argparse.BooleanOptionalAction: "switch",
        }.get(type(action), "custom")
        entry: dict[str, Any] = {
            "dest": action.dest,
            "option_strings": sorted(spellings[id(action)]),
            "kind": kind,
            "nargs": action.nargs,
            "type": _type_name(action.type) if action.nargs != 0 else None,
            "choices": None if action.choices is None else [_jsonable(c) for c in action.choices],
            "default": _jsonable(action.default),
        }
        if kind == "switch":
            entry["negative_option_strings"] = sorted(
                s
                for s in spellings[id(action)]
                if s in getattr(action, "negative_option_strings", ()) or s.startswith("--no-")
            )
        options.append(entry)
    options.sort(key=lambda o: o["dest"])
    return {
        "prog": "vllm serve",
        "allow_abbrev": parser.allow_abbrev,
        "positionals": positionals,
        "options": options,
    }


# --------------------------------------------------------------------------------------------
# Messages


def python_messages(site: Path, searched: dict[str, tuple[str, str]]) -> dict[str, list[dict[str, Any]]]:
    wanted = {k: [] for k in searched}  # type: dict[str, list[dict[str, Any]]]
    root = site / "vllm"
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not any(PY_MESSAGE_ANCHORS.get(k, frag) in text for k, (_, frag) in searched.items()):
            continue
        tree = ast.parse(text)
        # f-string parts are Constants too: skip those, keep the whole JoinedStr
        inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for lineno, node in literals(tree):
            if id(node) in inner:
                continue
            t = template(node)
            if t is None:
                continue
            style, text, exprs = t
            for key, (_, frag) in searched.items():
                if frag in text:
                    wanted[key].append(
                        {
                            "file": str(path.relative_to(site)),
                            "line": lineno,
                            "style": style,
                            "template": text,
                            "exprs": exprs,
                        }
                    )
    for key, param in PY_MESSAGE_DEFAULTS.items():
        if key in wanted and not wanted[key]:
            wanted[key] = composed_messages(site, searched[key][1], param)
    return wanted  # a key with no message is [] (formats() decides whether that may be)


def _strings(data: bytes, min_len: int = 12) -> list[str]:
    return [m.decode("ascii") for m in re.findall(rb"[\x20-\x7e]{%d,}" % min_len, data)]


def library_messages(site: Path) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for key, (lib, frag) in LIB_MESSAGES.items():
        path = site / "torch" / "lib" / lib
        hits = sorted({s for s in _strings(path.read_bytes()) if frag in s})
        out[key] = [  # none found: [] (formats() decides whether that may be)
            {
                "file": str(path.relative_to(site)),
                "line": None,
                "style": "fragment",
                "template": h,
                "exprs": [],
            }
            for h in hits
        ]
    for key, (lib, frag) in LIB_FORMATS.items():
        path = site / "torch" / "lib" / lib
        hits = sorted({s for s in _strings(path.read_bytes()) if frag in s})
        if len(hits) != 1 or re.search(r"\{[^}]", hits[0]):
            sys.exit(f"snapshot: {frag!r} is not one plain `{{}}` template in {path}: {hits}")
        out[key] = [
            {
                "file": str(path.relative_to(site)),
                "line": None,
                "style": "format",
                "template": hits[0],
                "exprs": [],
            }
        ]
    return out


# --------------------------------------------------------------------------------------------
# Engine facts


def download_log_threshold(site: Path) -> dict[str, Any]:
    """The `if <seconds> > X:` that guards the weights-download log line: X and where it is."""
    _, frag = PY_MESSAGES["weights_download_time"]
    tree = ast.parse((site / DOWNLOAD_LOG_SOURCE).read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If):
            continue
        test = node.test
        if not (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Gt)
            and isinstance(test.comparators[0], ast.Constant)
            and isinstance(test.comparators[0].value, (int, float))
        ):
            continue
        logs = any(
            isinstance(n, ast.Constant) and isinstance(n.value, str) and frag in n.value
            for stmt in node.body
            for n in ast.walk(stmt)
        )
        if logs:
            found.append(
                {"seconds": test.comparators[0].value, "line": node.lineno, "text": ast.unparse(test)}
            )
    if len(found) != 1:
        sys.exit(f"snapshot: no single `if … > X:` guards {frag!r} in {DOWNLOAD_LOG_SOURCE}; re-read it")
    return {"file": DOWNLOAD_LOG_SOURCE, **found[0]}


def engine_facts(site: Path) -> dict[str, Any]:
    from typing import get_args

    from torch.distributed.constants import default_pg_nccl_timeout
    from vllm.config import cache

    # KV_CACHE_DTYPES (a list plugins may extend) is the CacheDType Literal's values; a release
    # without that list accepts the Literal's values alone
    dtypes = getattr(cache, "KV_CACHE_DTYPES", None) or list(get_args(cache.CacheDType))

    rel, evidence = NULL_BLOCK_EVIDENCE
    lines = (site / rel).read_text(encoding="utf-8").splitlines()
    where = [i + 1 for i, line in enumerate(lines) if evidence in line]
    if len(where) != 1:
        sys.exit(f"snapshot: the null-block line {evidence!r} is not in {rel} exactly once; re-read it")
    extensible = extensible_facts(site)  # None: the release sizes the KV cache from estimates only
    return {
        **({} if extensible is None else {"extensible_kv_cache": extensible}),
        "default_block_size": cache.CacheConfig.DEFAULT_BLOCK_SIZE,
        "kv_cache_dtypes": list(dtypes),
        "null_blocks": 1,
        "null_block_source": {"file": rel, "line": where[0], "text": evidence},
        "weights_download_log": download_log_threshold(site),
        # --distributed-timeout-seconds unset: vLLM passes no timeout to init_process_group, so
        # torch's NCCL default applies (to the rendezvous and to every collective)
        "distributed_timeout": {
            "seconds": int(default_pg_nccl_timeout.total_seconds()),
            "source": "torch.distributed.constants.default_pg_nccl_timeout",
        },
    }


def formats(site: Path, version: str) -> dict[str, Any]:
    """formats.json: every recognised message, and the keys a release (or its CPU build) lacks."""
    messages = {**python_messages(site, py_messages(PY_MESSAGES)), **library_messages(site)}
    missing = sorted(k for k, v in messages.items() if not v)
    absent = expected_absent(site, version)
    if missing != sorted(absent):
        sys.exit(
            f"snapshot: vLLM {version}: no message found for {sorted(set(missing) - set(absent))}, "
            f"found {sorted(set(absent) - set(missing))} listed as absent; re-read the recognisers"
        )
    doc: dict[str, Any] = {"messages": {k: v for k, v in messages.items() if v}}
    if absent:
        doc["absent"] = dict(sorted(absent.items()))  # key -> why this release has no such message
    return doc


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    import vllm  # the package must import; its location is the source we read

    site = Path(vllm.__file__).resolve().parent.parent
    meta = {
        **release_meta(),  # vllm_version (the CPU build's is VERSION+cpu) and generated_by
        "torch_version": importlib.metadata.version("torch"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    docs = {
        "cli.json": {**meta, **cli_snapshot()},
        "formats.json": {**meta, **formats(site, meta["vllm_version"].split("+")[0])},
        "engine.json": {**meta, **engine_facts(site)},
        "surface.json": {**meta, **surface_snapshot(serve_parser(), site, is_cpu_build())},
        "config_checks.json": {**meta, **config_checks(site)},
    }
    for name, doc in docs.items():
        (out / name).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
