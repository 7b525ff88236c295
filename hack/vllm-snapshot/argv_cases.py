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

The config step. After the parser, the serve-args validation and ParallelConfig, each command that
got that far is built into vLLM's engine configuration the way `vllm serve` builds it
(`AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=OPENAI_API_SERVER)`),
over a local model folder holding a real config.json (the catalog's meta-llama/Meta-Llama-3-8B,
written to a temp dir, so every run reads the same model without a network); `real.config` is
"ok" or vLLM's message, and `starts` is false when vLLM refuses (a ValueError, TypeError or
NotImplementedError: pydantic's ValidationError is a ValueError), as the pod's own judge
(agent/rankguard_agent/engine_judge.py) counts it. Anything else it raises is recorded as
`unjudged: ...` and leaves `starts` as the earlier steps had it.

What the apply-time rules cannot see. A refusal may hang on the model (`-ep` on a dense model,
`--default-mm-loras` on a text-only one) or on files in the pod (`--chat-template auto` names a
file). For each case refused at the config step, the build is run again over a second catalog
model, a mixture-of-experts one (`OTHER_MODEL`), and recorded as `real.config_other_model`, and
over a third with one KV head (`MQA_MODEL`), as `real.config_mqa_model`; for
each case refused at the serve-args validation or the config step, the whole command is judged
again in a temp working directory holding each of its non-flag values as a file (a minimal jinja
template), recorded as `real.with_files` ("ok" or the refusal). A verdict that changes with the
model or with the files is the pod's own judge's to give (agent/rankguard_agent/engine_judge.py
runs in the pod, beside the model's config.json and the image's files): test_surface.py counts
those rows as "judged in the pod".

The GPU boundary, and what is not vLLM's own here: a rankguard pod runs vLLM's CUDA platform, and
the config build asks the platform for device facts (CUDA graphs, attention backends, block
size). This machine has no GPU and no libcuda, so the CUDA wheel would pick its CPU platform (we
import it with VLLM_TARGET_DEVICE=cpu), which turns CUDA graphs off and judges none of their
settings. `install_h100_platform` therefore installs vLLM's own `CudaPlatformBase` as the current
platform with the device facts of one H100 (sm_90, 80 GiB, NVLink) overridden, and, when libcuda
is missing, an empty stand-in for the `vllm._C_stable_libtorch` kernel library its module imports
(config building registers no kernel). The model class's facts (vLLM's registry inspects the
architecture in a subprocess and caches the result) are read once under the CPU platform into
a private VLLM_CACHE_ROOT before the switch (`warm_model_info`), because saving that cache
imports the flash-attention kernels, which need libcuda. The Hub is offline (HF_HUB_OFFLINE), and
refusals that come from what this machine lacks (`MACHINE`: a tokenizer, the Hub, libcuda,
Triton) are recorded as unjudged, never as vLLM's verdict on the command.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from argv_case_list import EDGES, generated_cases, primary  # this folder: which lists the table holds

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

MODEL = "org/model"
# The catalog entry whose config.json the config step builds over (operator/rankguard_operator/catalog/)
CONFIG_MODEL = "meta-llama--meta-llama-3-8b.json"
# The second model a refused case is built over: a mixture-of-experts one, so what vLLM refuses
# for a dense model only (expert parallelism, routed experts) shows as the model's doing
OTHER_MODEL = "qwen--qwen3-30b-a3b.json"
# And a third, with one KV head (multi-query attention): what vLLM refuses only because a model has
# more KV heads than tensor-parallel ranks (decode context parallelism) shows as the model's doing
MQA_MODEL = "google--gemma-3-1b-it.json"
# What a value turned into a file holds: a minimal chat template (the only file-valued option
# whose content vLLM reads before the engine starts)
FILE_TEXT = "{% for m in messages %}{{ m['content'] }}{% endfor %}\n"
CATALOG = Path(__file__).resolve().parents[2] / "operator" / "rankguard_operator" / "catalog"
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


# --------------------------------------------------------------------------------------------
# What vLLM does with one command line


_ADDRESS = re.compile(r" at 0x[0-9a-f]+>")


def _last_line(text: str) -> str:
    """The line of an error that says what is wrong (object addresses removed: the table must be
    the same bytes on every run)."""
    text = _ADDRESS.sub(">", text).replace(sys.prefix, "<venv>")  # the same bytes from any venv
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


# --------------------------------------------------------------------------------------------
# The config step's model folder and platform (the module docstring says why each is so)


def model_folder(catalog_entry: str = CONFIG_MODEL) -> Path:
    """A temp folder holding the catalog model's config.json, as a model folder in a pod holds it."""
    entry = json.loads((CATALOG / catalog_entry).read_text(encoding="utf-8"))
    folder = Path(tempfile.mkdtemp(prefix="rankguard-model-"))
    (folder / "config.json").write_text(json.dumps(entry["config"], indent=1), encoding="utf-8")
    return folder


def warm_model_info(folder: Path) -> None:
    """Have vLLM's registry inspect the folder's architecture once under the CPU platform, in a
    subprocess, so it caches the model class's facts (in this process's VLLM_CACHE_ROOT) before
    the CUDA platform is installed here."""
    arch = json.loads((folder / "config.json").read_text(encoding="utf-8"))["architectures"][0]
    code = (
        "import sys\n"
        "from vllm.model_executor.models.registry import ModelRegistry\n"
        "sys.exit(ModelRegistry._try_inspect_model_cls(sys.argv[1]) is None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, arch], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"vLLM could not inspect {arch} on CPU: {_last_line(done.stderr)}")


def install_h100_platform() -> None:
    """vLLM's own CUDA platform as the current platform, with one H100's device facts."""
    import types

    from vllm import platforms

    if platforms._current_platform is not None:
        raise SystemExit("vLLM's platform was resolved before the CUDA platform could be installed")
    try:
        import vllm._C_stable_libtorch  # noqa: F401  (the CUDA kernels: they need libcuda)
    except ImportError:
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    class H100(cuda.CudaPlatformBase):  # type: ignore[misc,name-defined]
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 << 30

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            return POD_GPUS

        @classmethod
        def get_device_numa_node(cls, device_id: int = 0) -> int | None:
            return None

        @classmethod
        def get_all_device_numa_nodes(cls) -> list[int] | None:
            return None

    platforms._current_platform = H100()


# What vLLM raises when it refuses a configuration (pydantic's ValidationError is a ValueError);
# anything else is this machine's, not a verdict (the pod's judge counts them alike).
REFUSALS = (ValueError, TypeError, NotImplementedError)
# Refusals that come from what this machine lacks, not from the command: the model folder has no
# tokenizer files, the Hub is offline, there is no libcuda (vLLM's cumem allocator) and no Triton
# (vLLM then falls back to its V1 model runner, which a GPU pod need not). Recorded as unjudged.
MACHINE = (
    "Couldn't instantiate the backend tokenizer",
    "Invalid repository ID or local directory",
    "Repo id must use alphanumeric chars",
    "cumem allocator is not supported on current platform",
    "requires Model Runner V2",
    "Model Runner V1 does not support",
)


def _config(args: Any, folder: Path) -> str:
    """ "ok", or vLLM's refusal of the engine configuration, as `vllm serve` builds it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    # a copy: vLLM's parser hands every parse the same default objects, and building a config
    # changes some of them in place (one case's `--enable-return-routed-experts` would be every
    # later case's)
    args = copy.deepcopy(args)
    args.model = str(folder)  # ServeSubcommand.cmd: args.model = args.model_tag
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            AsyncEngineArgs.from_cli_args(args).create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER
            )
    except REFUSALS as e:
        said = f"{type(e).__name__}: {_refusal(e)}".replace(str(folder), MODEL).replace(sys.prefix, "<venv>")
        return f"unjudged: {said}" if any(m in said for m in MACHINE) else said
    except Exception as e:
        return f"unjudged: {type(e).__name__}: {_last_line(str(e))}".replace(str(folder), MODEL)
    return "ok"


def _refusal(e: BaseException) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):  # pydantic: each error's place and message, without the input's repr
        return "; ".join(
            (f"{'.'.join(map(str, x['loc']))}: " if x["loc"] else "") + str(x["msg"]) for x in errors()
        )[:400]
    return _last_line(str(e)) or type(e).__name__


def _refused(verdict: str) -> bool:
    return not verdict.startswith(("ok", "unjudged"))


def with_files(parser: Any, serve: Any, argv: list[str], case: list[str], folder: Path) -> str:
    """The command judged again (parser, validation, config) in a temp working directory holding
    each of the case's non-flag values as a file: "ok", or the refusal."""
    here = Path.cwd()
    work = Path(tempfile.mkdtemp(prefix="rankguard-files-"))
    for item in case:
        # a flag's attached value (`--chat-template=-1`) is a value too
        value = item.split("=", 1)[1] if item.startswith("--") and "=" in item else item
        if (value.startswith("-") and value == item) or "/" in value or not value.strip() or len(value) > 100:
            continue
        with contextlib.suppress(OSError):
            (work / value).write_text(FILE_TEXT, encoding="utf-8")
    os.chdir(work)
    try:
        got = evaluate(parser, serve, argv, folder)
    finally:
        os.chdir(here)
    if got.get("parse") != "ok":
        return str(got.get("message") or got.get("parse"))
    if "validate" in got:
        return str(got["validate"])
    if "config" in got and _refused(got["config"]):
        return str(got["config"])
    return "ok"


def evaluate(parser: Any, serve: Any, argv: list[str], folder: Path | None = None) -> dict[str, Any]:
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
    if folder is not None:
        out["config"] = _config(args, folder)
        if not out["config"].startswith(("ok", "unjudged")):
            out["starts"] = False
    if launcher:
        out["message"] = "external_launcher: every rank is a process a launcher (torchrun) starts"
    elif multinode:
        out["message"] = f"nnodes={args.nnodes}: the engine waits for the other nodes to join"
    return out


def main() -> None:
    dest = Path(sys.argv[1])
    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="rankguard-vllm-cache-")
    # a value naming a repository (`--tokenizer none`) would be looked up on the Hub, with retries:
    # offline, the lookup fails at once and the case is recorded as unjudged
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    folder = model_folder()
    warm_model_info(folder)
    other = model_folder(OTHER_MODEL)
    warm_model_info(other)
    mqa = model_folder(MQA_MODEL)
    warm_model_info(mqa)
    install_h100_platform()
    import vllm  # noqa: F401  (the package must import)

    parser, serve = _top_parser()
    actions = _serve_actions(parser)
    by_dest = {a.dest: a for a in actions if a.option_strings}
    base: list[str] = []
    for d, value in BASE:
        base += [primary(by_dest[d])] + ([] if value is None else [value])
    seen: set[str] = set()
    rows = []
    for group, case in [*generated_cases(actions), *EDGES]:
        key = json.dumps(case)
        if key in seen:
            continue
        seen.add(key)
        argv = ["serve", MODEL, *base, *case]
        real = evaluate(parser, serve, argv, folder)
        if "config" in real and _refused(real["config"]):
            args = parser.parse_args(argv)
            real["config_other_model"] = _config(args, other)
            real["config_mqa_model"] = _config(parser.parse_args(argv), mqa)
        if "validate" in real or ("config" in real and _refused(real["config"])):
            real["with_files"] = with_files(parser, serve, argv, case, folder)
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
