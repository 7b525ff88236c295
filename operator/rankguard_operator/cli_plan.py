"""`rankguard plan`: the per-rank KV budget for a model and a split, offline, from priors (and any
figures measured by hand), with the `vllm` command line the operator would deploy with it.

(Over 450 lines because the command is one piece: its options, the spec they describe, and the
two ways it prints the plan, table and JSON, each per rank and, across pods, per pod.)

    rankguard plan --model meta-llama/Meta-Llama-3-70B --tp 8 --gpu-memory 80GiB \\
        --max-num-seqs 128 --logits gather [--json]

The command line is the renderer's own (`render.deployment.vllm_args`, over the spec these
options describe), so `rankguard plan` and `rankguard render` never print different flags.

Exit codes: 0 a feasible plan; 1 a plan was computed but cannot serve one request at
max_model_len (printed anyway, with the reason); 2 bad input; 3 a model rankguard does not
model (it measures such a model first instead).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.budget.bounds import kv_floor
from rankguard_operator.core.budget.kv_model import default_block_size
from rankguard_operator.core.budget.planner import Plan, PlanInput, RankMeasurement, make_plan
from rankguard_operator.core.engine.owned_flags import RUNTIME_QUANTIZATION
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.resolve import resolve_model
from rankguard_operator.core.names import POD_INDEX_LABEL
from rankguard_operator.core.render.pod import GroupNode, vllm_args
from rankguard_operator.core.spec.crd import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SAFETY_MARGIN_BYTES,
    LOGITS_MODES,
    SHAPE_OVERRIDE_KEYS,
)
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import QuantityError, format_bytes, parse_bytes


class UnmodelledError(Exception):
    """The model's architecture is not modelled: planning it from priors would be a guess."""


class CLIError(Exception):
    """Bad input found after argument parsing; main prints it as one line and exits 2."""


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except QuantityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def _rank_bytes(text: str) -> tuple[int, int]:
    rank, sep, value = text.partition("=")
    if not sep or not rank.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected RANK=BYTES, e.g. 0=74.2GiB")
    return int(rank), _bytes_arg(value)


def _shape_item(text: str) -> tuple[str, int | bool]:
    key, sep, value = text.partition("=")
    if not sep or key not in SHAPE_OVERRIDE_KEYS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KEY=VALUE with KEY one of {', '.join(SHAPE_OVERRIDE_KEYS)}"
        )
    if key == "tieWordEmbeddings":
        if value.lower() not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"{text!r}: tieWordEmbeddings is true or false")
        return key, value.lower() == "true"
    try:
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {key} must be an integer") from None


def add_plan(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="plan the per-rank KV-cache budget for a vLLM deployment",
        description=(
            "Estimate every rank's non-KV memory (weights, logits, sampler, activations, context/NCCL, "
            "CUDA graphs), name the bottleneck rank, and print the --kv-cache-memory-bytes that fits it."
        ),
    )
    src = p.add_argument_group("model (give --model, --config, or both)")
    src.add_argument("--model", help="model name, e.g. meta-llama/Meta-Llama-3-70B (built-in catalog)")
    src.add_argument("--config", type=Path, help="path to the model's Hugging Face config.json")
    src.add_argument(
        "--shape",
        type=_shape_item,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override one shape field ({', '.join(SHAPE_OVERRIDE_KEYS)}); repeatable",
    )
    p.add_argument("--gpu-memory", type=_bytes_arg, required=True, help="total memory of one GPU, e.g. 80GiB")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel size (default 1)")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline parallel size (default 1)")
    p.add_argument(
        "--pods",
        type=_positive_int,
        default=1,
        help="pods one replica spans (spec.distributed.podsPerGroup; default 1): which pod holds which "
        "ranks, and each pod's vLLM command line",
    )
    p.add_argument("--dtype", default="auto", help="vLLM --dtype (default auto: 16-bit)")
    p.add_argument(
        "--weight-dtype", default="auto", help="weight precision: auto, bfloat16, fp8, int8, int4, ..."
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM --kv-cache-dtype (default auto)")
    p.add_argument(
        "--vllm-version",
        type=_version,
        default=vllm_snapshots.latest().version,
        help="the vLLM release that will serve (its default block size and rules; default: the newest "
        f"recorded, {vllm_snapshots.latest().version}; an unrecorded one takes the nearest older one's)",
    )
    p.add_argument(
        "--block-size",
        type=_positive_int,
        help="default: the release's own (16 tokens up to vLLM 0.33, 64 from 0.34; 64 for MLA models)",
    )
    p.add_argument("--max-num-seqs", type=_positive_int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--max-model-len", type=_positive_int, help="default: the model's max_position_embeddings")
    p.add_argument(
        "--logits",
        choices=LOGITS_MODES,
        default="all-gather",
        help="where full-vocab logits live: gather (rank 0 only; vLLM v0, the rank-0 OOM article) or "
        "all-gather (every rank; vLLM v1, the default)",
    )
    p.add_argument(
        "--safety-margin",
        type=_bytes_arg,
        default=DEFAULT_SAFETY_MARGIN_BYTES,
        help=f"bytes kept free on the bottleneck rank (default {format_bytes(DEFAULT_SAFETY_MARGIN_BYTES)})",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM --enforce-eager)")
    p.add_argument(
        "--measured-free",
        type=_rank_bytes,
        action="append",
        default=[],
        metavar="RANK=BYTES",
        help="free memory of RANK after CUDA/NCCL init (replaces the context/NCCL prior); repeatable",
    )
    p.add_argument(
        "--measured-peak",
        type=_rank_bytes,
        action="append",
        default=[],
        metavar="RANK=BYTES",
        help="observed peak non-KV memory of RANK, context included (replaces the estimate); repeatable",
    )
    p.add_argument(
        "--quantization",
        choices=RUNTIME_QUANTIZATION,
        help="vLLM --quantization on an unquantised checkpoint (the spec's model.quantization)",
    )
    p.add_argument(
        "--allow-unmodelled",
        action="store_true",
        help="plan an architecture rankguard does not model from priors anyway (the operator measures "
        "such a model first instead); without it, rankguard plan refuses with exit code 3",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run_plan)


def _version(text: str) -> str:
    if vllm_snapshots.version_key(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a vLLM version (e.g. 0.34.0)")
    return text.strip().removeprefix("v")


def vllm_version(args: argparse.Namespace) -> str:
    """`--vllm-version` (a Namespace built without it: the newest recorded release)."""
    return getattr(args, "vllm_version", None) or vllm_snapshots.latest().version


def release(args: argparse.Namespace) -> vllm_snapshots.Snapshot:
    """The recorded release whose KV facts the plan uses (`--vllm-version`), as the operator
    picks it for an image of that tag (the nearest older snapshot for an unrecorded release)."""
    return vllm_snapshots.for_engine(vllm_version(args)).snapshot


def _load_config(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise CLIError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise CLIError(f"--config {path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise CLIError(f"--config {path} must hold a JSON object (a Hugging Face config.json)")
    return doc


def _measurements(args: argparse.Namespace) -> tuple[RankMeasurement, ...]:
    free = dict(args.measured_free)
    peak = dict(args.measured_peak)
    return tuple(
        RankMeasurement(rank=r, free_after_init_bytes=free.get(r), peak_non_kv_bytes=peak.get(r))
        for r in sorted(set(free) | set(peak))
    )


def plan_from_args(args: argparse.Namespace) -> Plan:
    if args.model is None and args.config is None:
        raise CLIError("give --model NAME or --config path/to/config.json")
    hf_config = _load_config(args.config) if args.config is not None else None
    name = args.model
    if name is None:
        assert hf_config is not None
        name = str(hf_config.get("_name_or_path") or args.config.resolve().parent.name or "config.json")
    shape = resolve_model(name, dict(args.shape) or None, hf_config=hf_config)
    if shape.unmodelled and not args.allow_unmodelled:
        raise UnmodelledError(
            f"{shape.unmodelled}: rankguard will not plan it from priors. In a cluster the operator "
            "measures it first (vLLM's own profile, then an explicit budget); pass --allow-unmodelled "
            "to see the prior plan anyway"
        )
    return make_plan(
        PlanInput(
            shape=shape,
            gpu_memory_bytes=args.gpu_memory,
            tp=args.tp,
            pp=args.pp,
            dtype=args.dtype,
            weight_dtype=args.weight_dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            block_size=args.block_size or default_block_size(shape, release(args)),
            null_blocks=release(args).null_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            logits_mode=args.logits,
            safety_margin_bytes=args.safety_margin,
            enforce_eager=args.enforce_eager,
            measured=_measurements(args),
            quantization=args.quantization,
        )
    )


def _group_spec(args: argparse.Namespace, doc: dict[str, Any]) -> dict[str, Any]:
    pods = getattr(args, "pods", 1)
    return {**doc, "distributed": {"podsPerGroup": pods}} if pods > 1 else doc


# The leader's address in a multi-node command line, for a service and namespace not named yet.
PLAN_LEADER_ADDRESS = "<llmservice>-g0-0.<llmservice>-nodes.<namespace>"


def _spec_doc(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """The LLMService spec these options describe. Its `vllm` arguments are the renderer's own,
    so `rankguard plan` and `rankguard render` never disagree; the spec is read as the operator
    reads one (parse_spec), so a value vLLM would refuse is refused here too; the rules are the
    `--vllm-version`'s (the image is a placeholder: only its tag's version matters)."""
    i = plan.inputs
    engine: dict[str, Any] = {
        "maxNumSeqs": i.max_num_seqs,
        "maxNumBatchedTokens": i.max_num_batched_tokens,
        "dtype": i.dtype,
        "kvCacheDtype": i.kv_cache_dtype,
        "enforceEager": i.enforce_eager,
        "logitsMode": i.logits_mode,
    }
    if args.max_model_len is not None:
        engine["maxModelLen"] = args.max_model_len
    if args.block_size is not None:
        engine["blockSize"] = args.block_size
    model: dict[str, Any] = {"name": i.shape.name}
    if args.shape:
        model["shape"] = dict(args.shape)
    if i.quantization is not None:
        model["quantization"] = i.quantization
    doc = {
        "model": model,
        # the release the plan's block size is the default of, so render plans it alike
        "image": f"vllm/vllm-openai:v{vllm_version(args)}",
        "tensorParallelSize": i.tp,
        "pipelineParallelSize": i.pp,
        "engine": engine,
        "memory": {"gpuMemoryBytes": i.gpu_memory_bytes, "safetyMarginBytes": i.safety_margin_bytes},
    }
    return _group_spec(args, doc)


def serve_args(args: argparse.Namespace, plan: Plan) -> list[str]:
    """The `vllm` arguments (from `serve`) of the pod the operator would render for the spec
    these options describe (the leader's, when a replica spans pods), with this plan's budget."""
    return _serve_args(_spec_doc(args, plan), plan)[0]


def _serve_args(doc: dict[str, Any], plan: Plan) -> tuple[list[str], list[str]]:
    """(the leader's or only pod's `vllm` arguments, a worker's; [] for one pod)."""
    try:
        spec = parse_spec(doc)
    except SpecError as exc:
        raise CLIError(str(exc)) from None
    # as the operator's first decision: a planned budget below the floor starts at the floor
    flags = ServingFlags(kv_cache_memory_bytes=max(plan.kv_cache_memory_bytes, kv_floor(spec, plan)))
    if spec.distributed is None:
        return vllm_args(spec, flags, plan), []
    d = spec.distributed
    leader, worker = (
        vllm_args(
            spec,
            flags,
            plan,
            node=GroupNode(
                nnodes=d.pods_per_group,
                role=role,
                master_addr=PLAN_LEADER_ADDRESS,
                master_port=d.rendezvous_port,
                node_rank_label=POD_INDEX_LABEL,
            ),
        )
        for role in ("leader", "worker")
    )
    return leader, worker


def worker_args(args: argparse.Namespace, plan: Plan) -> list[str]:
    """A worker pod's `vllm` arguments when the replica spans pods (--pods), else []."""
    if getattr(args, "pods", 1) <= 1:
        return []
    return _serve_args(_spec_doc(args, plan), plan)[1]


def pod_of(rank: int, plan: Plan, pods: int) -> int:
    """The pod (node rank) that holds global rank `rank` when a replica spans `pods` pods."""
    return rank // max(1, plan.inputs.tp * plan.inputs.pp // max(1, pods))


def plan_doc(
    plan: Plan, flags: list[str], pods: int = 1, worker_flags: list[str] | None = None
) -> dict[str, Any]:
    """The JSON of `rankguard plan --json`: the inputs, every rank's figures, the budget, and the
    `vllm` arguments the operator would deploy with it (`flags`; with `pods` > 1 the leader's,
    and `worker_flags` a worker's, whose node rank the pod's index gives)."""
    i = plan.inputs
    group = (
        {
            "pods": pods,
            "bottleneck_pod": pod_of(plan.bottleneck_rank, plan, pods),
            "worker_flags": list(worker_flags or []),
        }
        if pods > 1
        else {}
    )
    return {
        "model": i.shape.name,
        "tp": i.tp,
        "pp": i.pp,
        "logits_mode": i.logits_mode,
        "gpu_memory_bytes": i.gpu_memory_bytes,
        "dtype": i.dtype,
        "kv_cache_dtype": i.kv_cache_dtype,
        "block_size": i.block_size,
        "max_num_seqs": i.max_num_seqs,
        "max_num_batched_tokens": i.max_num_batched_tokens,
        "max_model_len": plan.max_model_len,
        "safety_margin_bytes": i.safety_margin_bytes,
        "ranks": [
            {
                "rank": r.rank,
                "pod": pod_of(r.rank, plan, pods),
                "pp_stage": r.pp_stage,
                "tp_rank": r.tp_rank,
                "layers": r.layers,
                "total_bytes": r.total_bytes,
                "weights_bytes": r.weights_bytes,
                "weights_source": r.weights_source,
                "logits_bytes": r.logits_bytes,
                "sampler_bytes": r.sampler_bytes,
                "activation_bytes": r.activation_bytes,
                "context_bytes": r.context_bytes,
                "context_source": r.context_source,
                "cudagraph_bytes": r.cudagraph_bytes,
                "non_kv_bytes": r.non_kv_bytes,
                "non_kv_source": r.non_kv_source,
                "safe_kv_bytes": r.safe_kv_bytes,
                "kv_bytes_per_token": r.kv_bytes_per_token,
                "blocks": r.blocks,
                "headroom_bytes": r.headroom_bytes,
            }
            for r in plan.ranks
        ],
        "bottleneck_rank": plan.bottleneck_rank,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "block_bytes": plan.block_bytes,
        "kv_cache_memory_bytes": plan.kv_cache_memory_bytes,
        "kv_cache_memory": format_bytes(plan.kv_cache_memory_bytes),
        "gpu_memory_utilization": plan.gpu_memory_utilization,
        "utilization_kv_bytes": plan.utilization_kv_bytes,
        "kv_blocks": plan.kv_blocks,
        "kv_tokens": plan.kv_tokens,
        "max_concurrency": round(plan.max_concurrency, 2),
        "min_kv_cache_memory_bytes": plan.min_kv_cache_memory_bytes,
        "naive_kv_cache_memory_bytes": plan.naive_kv_cache_memory_bytes,
        "skew_loss_bytes": plan.skew_loss_bytes,
        "skew_loss_tokens": plan.skew_loss_tokens,
        "feasible": plan.feasible,
        "warnings": list(plan.warnings),
        "flags": flags,
        **group,
    }


# (m) measured by rankguard; (e) the engine's own per-worker report
_NON_KV_MARK: dict[str, str] = {"estimate": "", "engine": " (e)"}

_COLUMNS: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("STAGE", lambda r: str(r.pp_stage)),
    ("WEIGHTS", lambda r: format_bytes(r.weights_bytes)),
    ("LOGITS", lambda r: format_bytes(r.logits_bytes)),
    ("SAMPLER", lambda r: format_bytes(r.sampler_bytes)),
    ("ACTIVATIONS", lambda r: format_bytes(r.activation_bytes)),
    ("CTX+NCCL", lambda r: format_bytes(r.context_bytes) + ("" if r.context_source == "prior" else " (m)")),
    ("CUDA-GRAPHS", lambda r: format_bytes(r.cudagraph_bytes)),
    ("NON-KV", lambda r: format_bytes(r.non_kv_bytes) + _NON_KV_MARK.get(r.non_kv_source, " (m)")),
    ("SAFE-KV", lambda r: format_bytes(r.safe_kv_bytes)),
    ("HEADROOM", lambda r: format_bytes(r.headroom_bytes)),
)


def render_plan(
    plan: Plan, flags: list[str], out: TextIO, pods: int = 1, worker_flags: list[str] | None = None
) -> None:
    """The human-readable plan: one header line, the per-rank table, the budget, the `vllm`
    command line the operator would deploy (`flags`, from `serve`; with `pods` > 1 the
    leader's, then a worker's)."""
    i = plan.inputs
    w = out.write
    w(
        f"{i.shape.name}: TP {i.tp}"
        + (f" x PP {i.pp}" if i.pp > 1 else "")
        + (f" over {pods} pods of {i.tp * i.pp // pods} GPUs" if pods > 1 else "")
        + f", {format_bytes(i.gpu_memory_bytes)} per GPU, logits {i.logits_mode}, "
        f"max_num_seqs {i.max_num_seqs}, "
        f"max_num_batched_tokens {i.max_num_batched_tokens}, max_model_len {plan.max_model_len}\n\n"
    )
    pod_col = pods > 1
    header = ["RANK", *(["POD"] if pod_col else []), *(name for name, _ in _COLUMNS)]
    rows = [
        [
            f"{r.rank}{'*' if r.rank == plan.bottleneck_rank else ''}",
            *([str(pod_of(r.rank, plan, pods))] if pod_col else []),
            *(cell(r) for _, cell in _COLUMNS),
        ]
        for r in plan.ranks
    ]
    widths = [max(len(row[c]) for row in [header, *rows]) for c in range(len(header))]
    for row in [header, *rows]:
        w("  ".join(cell.ljust(widths[c]) for c, cell in enumerate(row)).rstrip() + "\n")
    w("* bottleneck rank; (m) measured, otherwise a documented prior (see rankguard_operator/planner.py)\n\n")

    w(
        f"KV budget:        {format_bytes(plan.kv_cache_memory_bytes)} per GPU "
        f"({plan.kv_cache_memory_bytes} bytes), set by rank {plan.bottleneck_rank} "
        + (f"on pod {pod_of(plan.bottleneck_rank, plan, pods)} " if pod_col else "")
        + f"minus a {format_bytes(i.safety_margin_bytes)} margin, whole blocks\n"
    )
    w(f"KV per token:     {plan.kv_bytes_per_token:,} bytes per rank\n")
    w(
        f"Capacity:         {plan.kv_blocks:,} blocks of {i.block_size} = {plan.kv_tokens:,} tokens; "
        f"max concurrency {plan.max_concurrency:.2f}x at {plan.max_model_len:,} tokens per request\n"
    )
    w(
        f"Lost to skew:     {format_bytes(plan.skew_loss_bytes)} per GPU ({plan.skew_loss_tokens:,} tokens) "
        "compared with a budget sized for the least-loaded rank\n"
    )
    w(
        f"Utilization:      --gpu-memory-utilization {plan.gpu_memory_utilization:.4f} would give "
        f"{format_bytes(plan.utilization_kv_bytes)} of KV (prefer the explicit budget)\n\n"
    )
    if pod_col:
        w("Flags on the leader (pod 0, serves HTTP):\n  vllm " + " ".join(flags) + "\n")
        w(
            "Flags on every other pod (its node rank from its pod-index label):\n  vllm "
            + " ".join(worker_flags or [])
            + "\n"
        )
    else:
        w("Flags (the vLLM command line the operator deploys):\n  vllm " + " ".join(flags) + "\n")
    for warning in plan.warnings:
        w(f"\nwarning: {warning}\n")


def _run_plan(args: argparse.Namespace, out: TextIO) -> int:
    plan = plan_from_args(args)
    flags = serve_args(args, plan)
    workers = worker_args(args, plan)
    if args.json:
        out.write(json.dumps(plan_doc(plan, flags, args.pods, workers), indent=2) + "\n")
    else:
        render_plan(plan, flags, out, args.pods, workers)
    return 0 if plan.feasible else 1
