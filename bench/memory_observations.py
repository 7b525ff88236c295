"""The planner held against real, public vLLM start-up logs (tests/fixtures/vllm_observations.json).

    python bench/memory_observations.py [--markdown]

For every recorded observation whose model's config.json rankguard has (the built-in
catalog), it plans the same deployment (model, TP/PP, dtype, quantisation, max_model_len,
utilisation, GPU size) and sets side by side:

- weights per rank: planned vs vLLM's "Model loading took" (target within 3 %);
- KV: the tokens rankguard's KV layout gives for vLLM's printed "Available KV cache memory"
  vs the "GPU KV cache size" vLLM printed (target: equal, within the print's 0.01 GiB);
- the budget: the KV rankguard plans at the observation's gpu-memory-utilization
  (util x total - planned runtime non-KV) vs what vLLM says fits (available KV, less the
  CUDA graph pool vLLM captured afterwards when it printed one), target [90 %, 100 %] and
  never above.

Rows that lack a figure show "-"; misses are printed, not hidden. Pure computation over the
fixture: no GPU, no vLLM.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "agent")]

from rankguard_operator.core.budget.kv_model import stage_kv_layout, stage_range  # noqa: E402  # noqa: E402
from rankguard_operator.core.budget.planner import Plan, PlanInput, make_plan  # noqa: E402  # noqa: E402
from rankguard_operator.core.model.catalog import catalog_key, lookup_catalog  # noqa: E402  # noqa: E402
from rankguard_operator.core.model.shape import ModelShape  # noqa: E402  # noqa: E402
from rankguard_operator.core.units import GiB  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "vllm_observations.json"
# A device's total as torch/vLLM report it, where the log did not print it: the 80 GB class
# from the recorded H100 log ("79.22 GiB"); others from their NVML totals.
DEVICE_TOTAL_GIB = {
    "80GB": 79.22,
    "A800": 79.22,
    "H100": 79.22,
    "40GB": 39.39,
    "L40S": 44.39,
    "RTX 3090": 23.58,
}
# Checkpoints whose config.json the catalog lacks but whose layers are another's, figure for
# figure: Qwen2-7B and Qwen2.5-7B share hidden 3584, 28 layers, 28/4 heads, 18944, vocab 152064.
SAME_ARCHITECTURE = {"qwen2-7b": "Qwen/Qwen2.5-7B-Instruct"}
VLLM_DEFAULT_UTILIZATION = 0.9  # vLLM's default in the versions the logs come from
WEIGHTS_TOLERANCE = 0.03
BUDGET_RANGE = (0.90, 1.00)


@dataclass(frozen=True)
class Row:
    id: str
    model: str
    split: str
    shape: ModelShape | None
    weights_planned_gib: float | None = None
    weights_logged_gib: float | None = None
    kv_per_token: int | None = None
    tokens_planned: tuple[int, int] | None = None  # for available KV +- the print's rounding
    tokens_logged: int | None = None
    budget_planned_gib: float | None = None
    fits_gib: float | None = None
    note: str = ""

    @property
    def weights_ratio(self) -> float | None:
        if self.weights_planned_gib is None or not self.weights_logged_gib:
            return None
        return self.weights_planned_gib / self.weights_logged_gib

    @property
    def tokens_exact(self) -> bool | None:
        if self.tokens_planned is None or self.tokens_logged is None:
            return None
        lo, hi = self.tokens_planned
        return lo <= self.tokens_logged <= hi

    @property
    def budget_ratio(self) -> float | None:
        if self.budget_planned_gib is None or not self.fits_gib or self.fits_gib <= 0:
            return None
        return self.budget_planned_gib / self.fits_gib


def _repo(model: str) -> str:
    found = re.findall(r"[\w.-]+/[\w.-]+", model)
    return found[-1] if found else model.split(maxsplit=1)[0]


def _total_gib(obs: dict[str, Any]) -> float | None:
    if obs.get("gpu_total_gib"):
        return float(obs["gpu_total_gib"])
    gpu = str(obs.get("gpu") or "")
    for key, gib in DEVICE_TOTAL_GIB.items():
        if key in gpu:
            return gib
    return None


def _dtype(obs: dict[str, Any]) -> str:
    d = str(obs.get("dtype") or "auto").removeprefix("torch.")
    return d if d in ("bfloat16", "float16", "half") else "auto"


def batch_defaults(obs: dict[str, Any], total_gib: float) -> tuple[int, int]:
    """vLLM's (max_num_seqs, max_num_batched_tokens) for `vllm serve` when the log's command
    did not set them: 1024 and 8192 on a >= 70 GiB card that is not an A100, 256 and 2048
    otherwise (vLLM tests/engine/test_arg_utils.py::test_defaults_with_usage_context, as
    sim/rankguard_sim/scenarios/llama3-70b-tp4.yaml cites it)."""
    big = (
        total_gib >= 70
        and "A100" not in str(obs.get("gpu") or "")
        and "A800" not in str(obs.get("gpu") or "")
    )
    seqs = obs.get("max_num_seqs") or (1024 if big else 256)
    tokens = obs.get("max_num_batched_tokens") or (8192 if big else 2048)
    if _v0(obs) and not obs.get("max_num_batched_tokens"):
        # vLLM's v0 engine without chunked prefill profiled a whole max_model_len prompt
        tokens = max(tokens, int(obs.get("max_model_len") or 0))
    return seqs, max(seqs, tokens)


def _gpu_per_pod(obs: dict[str, Any]) -> bool:
    """The log's notes say each GPU was its own pod on its own node (a Ray group across nodes)."""
    notes = str(obs.get("notes") or "")
    return "one GPU per pod" in notes or "single-GPU pods on different nodes" in notes


def _v0(obs: dict[str, Any]) -> bool:
    return str(obs["id"]).endswith("-v0") or "V0" in str(obs.get("notes") or "")


def plan_for(obs: dict[str, Any], shape: ModelShape, total_gib: float) -> Plan:
    mml = obs.get("max_model_len") or min(shape.max_position_embeddings or 8192, 1 << 20)
    seqs, tokens = batch_defaults(obs, total_gib)
    return make_plan(
        PlanInput(
            shape=shape,
            gpu_memory_bytes=int(total_gib * GiB),
            tp=int(obs["tp"]),
            pp=int(obs["pp"]),
            dtype=_dtype(obs),
            kv_cache_dtype=str(obs.get("kv_cache_dtype") or "auto"),
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
            max_model_len=mml,
            block_size=obs.get("block_size") or 16,
            enforce_eager=bool(obs.get("enforce_eager")),
            quantization="fp8" if obs.get("quantization") == "fp8" and shape.quant is None else None,
            pods=int(obs["tp"]) * int(obs["pp"]) if _gpu_per_pod(obs) else 1,
        )
    )


def observe(obs: dict[str, Any]) -> Row:
    repo = _repo(str(obs["model"]))
    split = f"TP{obs['tp']}" + (f" PP{obs['pp']}" if obs["pp"] > 1 else "")
    shape = lookup_catalog(SAME_ARCHITECTURE.get(catalog_key(repo), repo))
    base = Row(id=obs["id"], model=repo, split=split, shape=shape)
    if shape is None:
        return Row(**{**base.__dict__, "note": f"no config.json for {catalog_key(repo)}"})
    first = shape.unmodelled or _connector(obs)
    total = _total_gib(obs) or 79.22
    plan = plan_for(obs, shape, total)
    r0 = plan.ranks[0]
    weights = r0.weights_bytes / GiB
    kv_tok = r0.kv_bytes_per_token
    tokens = None
    avail = obs.get("available_kv_gib")
    if avail is not None and avail > 0:
        layout = stage_kv_layout(
            shape,
            plan.inputs.tp,
            stage_range([r.layers for r in plan.ranks[:: plan.inputs.tp]], 0),
            kv_cache_dtype=plan.inputs.kv_cache_dtype,
            dtype=plan.inputs.dtype,
            block_size=plan.inputs.block_size,
        )
        lo, hi = int((avail - 0.005) * GiB), int((avail + 0.005) * GiB)
        tokens = (layout.tokens(lo, plan.max_model_len), layout.tokens(hi, plan.max_model_len))
    budget = fits = None
    util = obs.get("gpu_memory_utilization") or VLLM_DEFAULT_UTILIZATION
    if avail is not None and _total_gib(obs) is not None and not first:
        graphs = obs.get("cuda_graph_gib")
        # Without a captured pool in the log, both figures are before capture (vLLM before 0.21
        # never took graphs out of the KV cache): compare without the planned pool.
        non_kv = max(r.runtime_non_kv_bytes - (0 if graphs else r.cudagraph_bytes) for r in plan.ranks)
        # Engines that printed their non-torch memory counted all of it, the CUDA context too,
        # which vLLM 0.33 takes before its snapshot: subtract the log's own figure, as a probe's
        # measurement replaces the context prior.
        non_kv += int((obs.get("non_torch_gib") or 0.0) * GiB)
        budget = (util * total * GiB - non_kv) / GiB
        fits = avail - (graphs or 0.0)
    return Row(
        **{
            **base.__dict__,
            "weights_planned_gib": weights,
            "weights_logged_gib": obs.get("weights_gib"),
            "kv_per_token": kv_tok,
            "tokens_planned": tokens,
            "tokens_logged": obs.get("kv_tokens"),
            "budget_planned_gib": budget,
            "fits_gib": fits,
            "note": f"measure-first: {first}" if first else "",
        }
    )


def _connector(obs: dict[str, Any]) -> str:
    """A KV connector in the command: rankguard measures such a service first (model_source)."""
    text = " ".join([str(obs.get("notes") or ""), *map(str, obs.get("lines") or [])])
    return "a KV connector (LMCache) holds GPU memory" if "kv-transfer-config" in text else ""


def rows() -> list[Row]:
    doc = json.loads(FIXTURE.read_text())
    return [observe(o) for o in doc["observations"]]


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(rs: list[Row]) -> str:
    head = (
        "| observation | model | split | weights/rank planned / logged GiB | KV B/token/rank | "
        "KV tokens planned / logged | budget planned / fits GiB | verdict |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in rs:
        verdicts = []
        if r.weights_ratio is not None:
            ok = abs(r.weights_ratio - 1) <= WEIGHTS_TOLERANCE
            verdicts.append(f"weights {r.weights_ratio - 1:+.1%}{'' if ok else ' MISS'}")
        if r.tokens_exact is not None:
            verdicts.append("tokens exact" if r.tokens_exact else "tokens MISS")
        if r.budget_ratio is not None:
            lo, hi = BUDGET_RANGE
            ok = lo <= r.budget_ratio <= hi
            verdicts.append(f"budget {r.budget_ratio:.1%}{'' if ok else ' MISS'}")
        toks = "-"
        if r.tokens_planned is not None:
            toks = f"{r.tokens_planned[0]:,}-{r.tokens_planned[1]:,} / {_f(r.tokens_logged, '{:,}')}"
        lines.append(
            f"| {r.id} | {r.model} | {r.split} | {_f(r.weights_planned_gib)} / {_f(r.weights_logged_gib)} | "
            f"{_f(r.kv_per_token, '{:,}')} | {toks} | {_f(r.budget_planned_gib)} / {_f(r.fits_gib)} | "
            f"{'; '.join([*verdicts, r.note] if r.note else verdicts) or '-'} |"
        )
    return "\n".join(lines)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(table(rows()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
