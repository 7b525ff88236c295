"""Oracle for rankguard_operator/core/budget/kv_layout.py: ask the REAL vLLM how it turns per-layer KV specs
and a --kv-cache-memory-bytes budget into blocks, tokens, max concurrency and a minimum budget.

    VLLM_TARGET_DEVICE=cpu ~/.cache/rankguard/vllm-0.33.0/bin/python hack/vllm-snapshot/kv_layouts.py \
        tests/fixtures/vllm_kv_layouts.json

Runs INSIDE the venv that has the real `vllm` installed (see run.sh); nothing is started. For each
case it builds real `KVCacheSpec` objects (FullAttentionSpec, SlidingWindowSpec,
ChunkedLocalAttentionSpec, MLAAttentionSpec, MambaSpec) and calls the same functions the engine
core calls in `EngineCore._initialize_kv_caches` (vllm/v1/engine/core.py):

- `Platform._align_hybrid_block_size` (vllm/platforms/interface.py) for attention+mamba models,
  with a stand-in attention backend declaring FlashAttention's SM90 kernel block sizes
  ([MultipleOf(16)], vllm/v1/attention/backends/flash_attn.py);
- `get_global_kv_cache_groups` and `get_kv_cache_configs` (vllm/v1/core/kv_cache_planning.py),
  including its enough-memory check (a ValueError means vLLM refuses to start);
- `generate_scheduler_kv_cache_config` and `get_kv_cache_capacity` (vllm/v1/core/kv_cache_utils.py),
  the figures of the "GPU KV cache size: N tokens, Maximum concurrency ..." line.

The smallest budget vLLM accepts is found by bisection over `get_kv_cache_configs` itself. The
VllmConfig is a stand-in object that carries only the fields those functions read (the real one
needs a model checkpoint). Qwen3-Next's gated-delta-net state shapes and dtypes come from vLLM's
own `Qwen3NextForCausalLM.get_mamba_state_shape_from_config` / `..._dtype_from_config`.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

COMMAND = (
    "VLLM_TARGET_DEVICE=cpu ~/.cache/rankguard/vllm-0.33.0/bin/python "
    "hack/vllm-snapshot/kv_layouts.py tests/fixtures/vllm_kv_layouts.json"
)
GiB = 1 << 30
# 10000 is no multiple of any block size: it checks the float in vLLM's printed token count.
MAX_MODEL_LENS = (4096, 10000, 32768, 131072)
BUDGETS = (1 * GiB, 3 * GiB, 8 * GiB, 20 * GiB, 61 * GiB + 12345)
# vLLM's scheduling defaults on an H100/H200-class GPU for `vllm serve` (engine/arg_utils.py:
# get_batch_defaults: max_num_batched_tokens 8192) with async scheduling (config/vllm.py:
# max_concurrent_batches = 2): max_in_flight_tokens = 2 x 8192.
MAX_NUM_BATCHED_TOKENS = 8192
MAX_CONCURRENT_BATCHES = 2


def _dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}[name]


class _Config:
    """A stand-in VllmConfig with only the fields kv_cache_planning / kv_cache_utils read."""

    def __init__(self, *, block_size: int, max_model_len: int, tp: int, hybrid: bool, mamba_mode: str):
        self.model_config = SimpleNamespace(
            max_model_len=max_model_len,
            original_max_model_len=max_model_len,
            supports_kv_cache_grouping=False,
        )
        self.cache_config = SimpleNamespace(
            block_size=block_size,
            num_gpu_blocks_override=None,
            prefix_cache_retention_interval=None,
            kv_cache_layout="LBNHC",  # FlashAttention declares no layouts: the default preference's first
            mamba_cache_mode=mamba_mode,
            kv_cache_size_tokens=None,
            kv_cache_max_concurrency=None,
        )
        from vllm.config.cache import _layout_from_name

        self.cache_config.get_resolved_kv_cache_layout = lambda: _layout_from_name("LBNHC")
        self.scheduler_config = SimpleNamespace(
            disable_hybrid_kv_cache_manager=not hybrid,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        )
        self.parallel_config = SimpleNamespace(
            tensor_parallel_size=tp,
            decode_context_parallel_size=1,
            pipeline_parallel_size=1,
        )
        self.attention_config = SimpleNamespace(hisparse_config=None)
        self.device_config = SimpleNamespace(device_type="cuda")
        self.speculative_config = None
        self.num_prefill_lookahead_tokens = 0
        self.max_in_flight_tokens = MAX_CONCURRENT_BATCHES * MAX_NUM_BATCHED_TOKENS


# ------------------------------------------------------------------------------------------------
# Cases: (name, tp, block_size, layers, options). A layer is a tuple
#   ("full"|"sliding"|"chunked", kv_heads_per_rank, head_dim, dtype, window) |
#   ("mla", latent, rope, dtype) | ("gdn",)


def _llama8b(tp: int, dtype: str) -> list[tuple[Any, ...]]:
    return [("full", 8 // tp, 128, dtype, 0)] * 32


def _alternating(n: int, window: int, kv_heads: int, head_dim: int) -> list[tuple[Any, ...]]:
    # Gemma-2 and gpt-oss: even layers slide, odd layers attend to everything.
    return [("sliding" if i % 2 == 0 else "full", kv_heads, head_dim, "bf16", window) for i in range(n)]


def _llama4(n: int) -> list[tuple[Any, ...]]:
    # Llama-4: every 4th layer is global (NoPE) attention, the others chunked local (8192).
    return [("full" if i % 4 == 3 else "chunked", 8, 128, "bf16", 8192) for i in range(n)]


def _qwen3_next(tp: int) -> list[tuple[Any, ...]]:
    # Qwen3-Next-80B-A3B: full_attention_interval 4 (layers 3, 7, ...), 2 KV heads x 256.
    kv = max(1, 2 // tp)
    return [("full", kv, 256, "bf16", 0) if i % 4 == 3 else ("gdn",) for i in range(48)]


CASES: list[tuple[str, int, int, list[tuple[Any, ...]], dict[str, Any]]] = [
    ("llama3.1-8b-tp1", 1, 16, _llama8b(1, "bf16"), {}),
    ("llama3.1-8b-tp2", 2, 16, _llama8b(2, "bf16"), {}),
    ("llama3.1-8b-tp1-bs32", 1, 32, _llama8b(1, "bf16"), {}),
    ("llama3.1-8b-fp8-tp1", 1, 16, _llama8b(1, "fp8"), {}),
    ("deepseek-v2-lite-mla-bs16", 1, 16, [("mla", 512, 64, "bf16")] * 27, {}),
    ("deepseek-v2-lite-mla-bs64", 1, 64, [("mla", 512, 64, "bf16")] * 27, {}),
    ("gemma2-9b-like", 1, 16, _alternating(42, 4096, 8, 256), {}),
    ("gemma2-9b-like-nohma", 1, 16, _alternating(42, 4096, 8, 256), {"hybrid": False}),
    ("gpt-oss-20b-like", 1, 16, _alternating(24, 128, 8, 64), {}),
    ("gpt-oss-120b-like-tp2", 2, 16, _alternating(36, 128, 4, 64), {}),
    ("mistral-7b-v0.1-like-all-sliding", 1, 16, [("sliding", 8, 128, "bf16", 4096)] * 32, {}),
    ("llama4-like-chunked-default", 1, 16, _llama4(48), {"hybrid": False}),
    ("llama4-like-chunked-hma", 1, 16, _llama4(48), {"hybrid": True}),
    ("qwen3-next-tp1", 1, 16, _qwen3_next(1), {}),
    ("qwen3-next-tp4", 4, 16, _qwen3_next(4), {}),
    ("qwen3-next-tp1-prefix-caching", 1, 16, _qwen3_next(1), {"mamba_mode": "align"}),
    ("qwen3-next-tp4-prefix-caching", 4, 16, _qwen3_next(4), {"mamba_mode": "align"}),
]


def _qwen3_next_hf() -> SimpleNamespace:
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json, the fields the state-shape helper reads.
    return SimpleNamespace(
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
    )


def _mamba_state(tp: int) -> tuple[tuple[tuple[int, ...], ...], tuple[Any, ...]]:
    import torch
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM

    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(hf_text_config=_qwen3_next_hf(), dtype=torch.bfloat16),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto"),
        speculative_config=None,
    )
    shapes = tuple(tuple(s) for s in Qwen3NextForCausalLM.get_mamba_state_shape_from_config(cfg))
    dtypes = tuple(Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(cfg))
    return shapes, dtypes


def _align_hybrid(
    block_size: int, tp: int, attn_heads: int, head_dim: int, mamba_mode: str
) -> tuple[int, int]:
    """vLLM's own Platform._align_hybrid_block_size: the raised block size and the mamba page padding."""
    import torch
    import vllm.model_executor.layers.mamba.abstract as mamba_abstract
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT

    class _FlashAttnSM90:
        # FlashAttention's kernel block sizes on SM90 (flash_attn.py: get_supported_kernel_block_sizes).
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
            return [MultipleOf(16)]

        @staticmethod
        def customize_spec(spec: Any) -> Any:
            return spec

        @staticmethod
        def supports_block_size(bs: int) -> bool:
            return bs % 16 == 0

        @staticmethod
        def get_name() -> str:
            return "FLASH_ATTN"

    class _Plat(Platform):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config: Any) -> list[Any]:
            return [_FlashAttnSM90]

    hf = _qwen3_next_hf()
    cfg = _Config(block_size=block_size, max_model_len=4096, tp=tp, hybrid=True, mamba_mode=mamba_mode)
    cfg.cache_config.cache_dtype = "auto"
    cfg.cache_config.mamba_page_size_padded = None
    cfg.cache_config.mamba_block_size = block_size if mamba_mode == "align" else 4096
    cfg.cache_config.mamba_cache_dtype = "auto"
    cfg.cache_config.mamba_ssm_cache_dtype = "auto"
    cfg.model_config.dtype = torch.bfloat16
    cfg.model_config.use_mla = False
    cfg.model_config.architecture = "Qwen3NextForCausalLM"
    cfg.model_config.hf_text_config = hf
    cfg.model_config.get_num_kv_heads = lambda pc: attn_heads
    cfg.model_config.get_head_size = lambda: head_dim
    # FlashInfer GDN prefill (the SM90 default) exports checkpoints every 64 tokens in align mode
    # (model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py); the real helper walks built layers.
    align = FLASHINFER_GDN_CHECKPOINT_ALIGNMENT if mamba_mode == "align" else None
    saved = mamba_abstract.get_mamba_prefill_checkpoint_alignment
    mamba_abstract.get_mamba_prefill_checkpoint_alignment = lambda vc: align
    # The registry resolves the architecture from a full ModelConfig; hand it the class directly.
    registry = ModelRegistry.__dict__.get("resolve_model_cls")
    ModelRegistry.resolve_model_cls = lambda arch, model_config: (Qwen3NextForCausalLM, arch)
    try:
        _Plat._align_hybrid_block_size(cfg, _FlashAttnSM90)
    finally:
        mamba_abstract.get_mamba_prefill_checkpoint_alignment = saved
        if registry is None:
            del ModelRegistry.resolve_model_cls
        else:
            ModelRegistry.resolve_model_cls = registry
    return cfg.cache_config.block_size, cfg.cache_config.mamba_page_size_padded


def _specs(
    layers: list[tuple[Any, ...]], block_size: int, tp: int, mamba_mode: str
) -> tuple[dict[str, Any], list[dict[str, Any]], int, dict[str, Any]]:
    """vLLM specs per layer name, rankguard's LayerKV dicts, the block size in effect, extras."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    extras: dict[str, Any] = {}
    padded = None
    mamba_pages = 1
    if any(layer[0] == "gdn" for layer in layers):
        attn = next(layer for layer in layers if layer[0] != "gdn")
        block_size, padded = _align_hybrid(block_size, tp, attn[1], attn[2], mamba_mode)
        shapes, dtypes = _mamba_state(tp)
        extras["mamba_state_shapes"] = [list(s) for s in shapes]
        extras["mamba_state_dtypes"] = [str(d) for d in dtypes]
        # Qwen GDN layers on FlashInfer add one prefill checkpoint block in align mode
        # (qwen_gdn_linear_attn.py: get_kv_cache_spec, num_prefill_checkpoint_blocks=1).
        ckpt = 1 if mamba_mode == "align" else 0
        mamba_pages = (2 + ckpt) if mamba_mode == "align" else 1
    specs: dict[str, Any] = {}
    ours: list[dict[str, Any]] = []
    for i, layer in enumerate(layers):
        name = f"model.layers.{i}.attn"
        kind = layer[0]
        if kind == "gdn":
            spec = MambaSpec(
                shapes=shapes,
                dtypes=dtypes,
                block_size=block_size if mamba_mode == "align" else 4096,
                page_size_padded=padded,
                mamba_cache_mode=mamba_mode,
                num_prefill_checkpoint_blocks=1 if mamba_mode == "align" else 0,
                prefill_checkpoint_alignment=64 if mamba_mode == "align" else None,
            )
            raw = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=1).page_size_bytes
            ours.append({"kind": "mamba", "state_bytes": raw})
        elif kind == "mla":
            _, latent, rope, dt = layer
            spec = MLAAttentionSpec(
                block_size=block_size,
                num_kv_heads=1,
                head_size=latent + rope,
                dtype=_dtype(dt),
                cache_dtype_str="auto",
            )
            ours.append({"kind": "mla", "bytes_per_token": spec.page_size_bytes // block_size})
        else:
            _, heads, head_dim, dt, window = layer
            common = {
                "block_size": block_size,
                "num_kv_heads": heads,
                "head_size": head_dim,
                "dtype": _dtype(dt),
            }
            if kind == "full":
                spec = FullAttentionSpec(**common)
            elif kind == "sliding":
                spec = SlidingWindowSpec(**common, sliding_window=window)
            else:
                spec = ChunkedLocalAttentionSpec(**common, attention_chunk_size=window)
            entry: dict[str, Any] = {"kind": kind, "bytes_per_token": spec.page_size_bytes // block_size}
            if kind != "full":
                entry["window"] = window
            ours.append(entry)
        specs[name] = spec
    extras["mamba_pages_per_request"] = mamba_pages
    return specs, ours, block_size, extras


def _plan(
    specs: dict[str, Any], block_size: int, mml: int, budget: int, *, tp: int, hybrid: bool, mamba_mode: str
) -> tuple[Any, Any] | None:
    """(KV cache config of the one worker, the scheduler's); None when vLLM refuses the budget."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    cfg = _Config(block_size=block_size, max_model_len=mml, tp=tp, hybrid=hybrid, mamba_mode=mamba_mode)
    worker = dict(specs)
    groups = get_global_kv_cache_groups(cfg, [worker])
    try:
        configs = get_kv_cache_configs(cfg, [worker], [budget], groups)
    except ValueError:
        return None
    return cfg, (configs[0], generate_scheduler_kv_cache_config(configs))


def _min_budget(specs: dict[str, Any], block_size: int, mml: int, *, tp: int, hybrid: bool, mode: str) -> int:
    lo, hi = 1, 1 << 20
    while _plan(specs, block_size, mml, hi, tp=tp, hybrid=hybrid, mamba_mode=mode) is None:
        lo, hi = hi, hi * 2
    while lo < hi:  # smallest accepted budget
        mid = (lo + hi) // 2
        if _plan(specs, block_size, mml, mid, tp=tp, hybrid=hybrid, mamba_mode=mode) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _group_kind(spec: Any) -> tuple[str, int]:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = spec.first_spec
    if isinstance(spec, MambaSpec):
        return "mamba", 0
    if isinstance(spec, MLAAttentionSpec):
        return "mla", 0
    if isinstance(spec, SlidingWindowSpec):
        return "sliding", spec.sliding_window
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return "chunked", spec.attention_chunk_size
    return "full", 0


def run_case(
    name: str, tp: int, block_size: int, layers: list[tuple[Any, ...]], opts: dict[str, Any]
) -> dict[str, Any]:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    hybrid = opts.get("hybrid", True)
    mode = opts.get("mamba_mode", "none")
    specs, ours, bs, extras = _specs(layers, block_size, tp, mode)
    out: dict[str, Any] = {
        "name": name,
        "tp": tp,
        "block_size_arg": block_size,
        "hybrid_allocator": hybrid,
        "mamba_pages_per_request": extras.pop("mamba_pages_per_request"),
        "mamba_checkpoint_alignment": 64 if mode == "align" else 1,
        "max_in_flight_tokens": MAX_CONCURRENT_BATCHES * MAX_NUM_BATCHED_TOKENS,
        "layers": ours,
        **extras,
        "results": [],
        "min_budget_bytes": {},
    }
    for mml in MAX_MODEL_LENS:
        out["min_budget_bytes"][str(mml)] = _min_budget(specs, bs, mml, tp=tp, hybrid=hybrid, mode=mode)
        for budget in BUDGETS:
            planned = _plan(specs, bs, mml, budget, tp=tp, hybrid=hybrid, mamba_mode=mode)
            if planned is None:
                out["results"].append({"max_model_len": mml, "budget_bytes": budget, "refused": True})
                continue
            cfg, (worker, sched) = planned
            tokens, conc = get_kv_cache_capacity(cfg, sched)
            out["results"].append(
                {
                    "max_model_len": mml,
                    "budget_bytes": budget,
                    "refused": False,
                    "num_blocks": worker.num_blocks,
                    "tokens": tokens,
                    "max_concurrency": conc,
                    "max_concurrency_printed": f"{conc:.2f}",
                }
            )
            if "layout" not in out:
                groups = worker.kv_cache_groups
                page = {t.size // worker.num_blocks for t in worker.kv_cache_tensors}
                assert len(page) == 1
                out["layout"] = {
                    "block_size": min(
                        g.kv_cache_spec.block_size
                        for g in groups
                        if _group_kind(g.kv_cache_spec)[0] != "mamba"
                    ),
                    "page_bytes": _page_bytes(groups),
                    "bytes_per_block": page.pop(),
                    "groups": [[*_group_kind(g.kv_cache_spec), len(g.layer_names)] for g in groups],
                }
    return out


def _page_bytes(groups: list[Any]) -> int:
    from vllm.v1.kv_cache_interface import iter_layer_specs

    pages = {s.page_size_bytes for g in groups for s in iter_layer_specs(g.kv_cache_spec)}
    return max(pages)


def main() -> None:
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("tests/fixtures/vllm_kv_layouts.json")
    version = importlib.metadata.version("vllm")
    cases = [run_case(*case) for case in CASES]
    doc = {
        "vllm_version": version,
        "generated_by": COMMAND,
        "note": (
            "Read by tests/unit/core/budget/test_kv_layout.py; "
            "regenerate with the command above, never by hand."
        ),
        "cases": cases,
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
