"""A checkpoint's (or vLLM's runtime) weight quantisation, module by module.

`quant_scheme(config.json's quantization_config)` understands the formats people serve:
FP8 (per-tensor, per-channel and DeepSeek's 128x128 blocks; HF "fp8", "fbgemm_fp8",
ModelOpt), compressed-tensors (`config_groups.*.weights.num_bits`, group size, `ignore`),
AWQ and GPTQ int4/int8 with group scales, MXFP4 (gpt-oss) and bitsandbytes. Modules a
checkpoint keeps in 16-bit (`ignore`, `modules_to_not_convert`, `ignored_layers`,
`exclude_modules`, `llm_int8_skip_modules`) are matched by name, as vLLM matches them:
`re:` regexes, `*` globs, and names matched whole at dot boundaries (a prefix names a whole
sub-tree). A format it does not know raises `UnknownQuantization`: the caller goes
measure-first rather than plan a guess.

Only the transformer blocks' Linear layers are ever quantised here; embeddings, the LM head,
norms and MoE routers stay in the activation dtype (vLLM loads them so for these formats).
Pure: no I/O.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.engine.owned_flags import RUNTIME_QUANTIZATION


class UnknownQuantization(ValueError):
    """A quantisation format (or its parameters) rankguard cannot size."""


@dataclass(frozen=True)
class QuantScheme:
    """Weight bits of the quantised Linear layers and the cost of their scales.

    A group of `group_size` weights carries `scale_bytes` of scale (and `zero_bytes` of zero
    point); group_size 0 means per-tensor or per-channel scales, a rounding error next to the
    weights."""

    method: str
    bits: int
    group_size: int = 0
    scale_bytes: float = 0.0
    zero_bytes: float = 0.0
    ignore: tuple[str, ...] = ()
    only: tuple[str, ...] = ()  # when set, only modules matching one of these are quantised
    # MoE kernels that need aligned tiles pad each expert's (per-rank) intermediate and hidden
    # dimensions up to these multiples when loading (0: none)
    expert_padding: int = 0
    expert_hidden_padding: int = 0

    def bits_for(self, module: str) -> int | None:
        """The bits of `module` (an HF-style name such as model.layers.3.mlp.down_proj), or
        None when the checkpoint keeps it unquantised."""
        return _bits_for(self, module)

    def linear_bytes(self, params: int) -> int:
        """Bytes of `params` quantised weights with their scales and zero points."""
        weights = -(-params * self.bits // 8)
        if self.group_size:
            groups = -(-params // self.group_size)
            weights += int(groups * (self.scale_bytes + self.zero_bytes) + 0.999)
        return weights

    def describe(self) -> str:
        g = f", group {self.group_size}" if self.group_size else ""
        kept = f", {len(self.ignore)} module pattern(s) kept 16-bit" if self.ignore else ""
        return f"{self.method} {self.bits}-bit{g}{kept}"


@functools.lru_cache(maxsize=65536)
def _bits_for(scheme: QuantScheme, module: str) -> int | None:
    # cached: an FP8 checkpoint can list hundreds of kept modules, and every plan asks per layer
    if any(_matches(p, module) for p in scheme.ignore):
        return None
    if scheme.only and not any(_matches(p, module) for p in scheme.only):
        return None
    return scheme.bits


@functools.lru_cache(maxsize=4096)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return _regex(pattern[3:]).match(module) is not None
    if "*" in pattern or "?" in pattern:
        return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")
    # a name matches itself and its sub-modules ("lm_head", "visual", "model.layers.0.mlp"),
    # also under a multimodal wrapper's prefix on either side ("language_model.model.layers.0
    # .self_attn.q_proj" names model.layers.0.self_attn.q_proj), but never a longer sibling
    # (layers.1 is not layers.10)
    if pattern.endswith("." + module):
        return True
    return _regex(rf"(^|\.){re.escape(pattern)}(\.|$)").search(module) is not None


def _int(q: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    v = q.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise UnknownQuantization(f"quantization_config.{key} must be an integer, got {v!r}")
    return v


def _names(q: Mapping[str, Any], *keys: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in keys:
        v = q.get(key)
        if v is None:
            continue
        if not isinstance(v, Sequence) or isinstance(v, str) or not all(isinstance(x, str) for x in v):
            raise UnknownQuantization(f"quantization_config.{key} must be a list of module names")
        out += v
    return tuple(out)


_KEPT_KEYS = (
    "ignore",
    "modules_to_not_convert",
    "ignored_layers",
    "exclude_modules",
    "llm_int8_skip_modules",
)


def quant_scheme(q: Any) -> QuantScheme | None:
    """The scheme of a config.json `quantization_config` (None: not quantised). Raises
    UnknownQuantization for formats or parameters it cannot size."""
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise UnknownQuantization("quantization_config must be an object")
    method = str(q.get("quant_method", "")).lower()
    kept = _names(q, *_KEPT_KEYS)
    if method in ("fp8", "fbgemm_fp8", "ptpc_fp8"):
        block = q.get("weight_block_size")
        if block is not None:
            if not (
                isinstance(block, Sequence)
                and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)
            ):
                raise UnknownQuantization(
                    f"quantization_config.weight_block_size {block!r} is not [rows, cols]"
                )
            return QuantScheme(method, 8, group_size=block[0] * block[1], scale_bytes=4, ignore=kept)
        return QuantScheme(method, 8, ignore=kept)
    if method == "modelopt":
        algo = str(q.get("quant_algo", "FP8")).upper()
        if algo.startswith("FP8"):
            return QuantScheme("modelopt-fp8", 8, ignore=kept)
        if algo.startswith("NVFP4"):
            return QuantScheme("modelopt-nvfp4", 4, group_size=16, scale_bytes=1, ignore=kept)
        raise UnknownQuantization(f"ModelOpt quant_algo {algo!r} is not modelled")
    if method == "compressed-tensors":
        return _compressed_tensors(q, kept)
    if method in ("awq", "gptq", "awq_marlin", "gptq_marlin"):
        bits = _int(q, "bits", _int(q, "w_bit"))
        if bits not in (2, 3, 4, 8):
            raise UnknownQuantization(f"{method} with {bits!r} bits is not modelled")
        group = _int(q, "group_size", _int(q, "q_group_size", 128)) or 0
        zero = bool(q.get("zero_point", True)) if method.startswith("awq") else not bool(q.get("sym", True))
        # scales are 16-bit per group; zero points are packed at the weight's own bit width
        return QuantScheme(
            method.removesuffix("_marlin"),
            bits,
            group_size=group if group > 0 else 0,
            scale_bytes=2,
            zero_bytes=bits / 8 if zero else 0.0,
            ignore=kept,
        )
    if method == "mxfp4":
        # gpt-oss: the experts' weights in 4-bit e2m1 blocks of 32 with one 8-bit scale each.
        # vLLM 0.33 rounds the expert dimensions up for its MXFP4 MoE kernel
        # (fused_moe/oracle/mxfp4.py, mxfp4_round_up_hidden_size_and_intermediate_size): Marlin
        # (A100, and H100 before the Triton kernels) and FlashInfer TRT-LLM (B200) take the
        # hidden size to 256 and the per-rank intermediate to 128; CUTLASS/DeepGEMM 128 and
        # 128; Triton (H100) only the intermediate, to 64. The largest any CUDA backend asks is
        # counted, so the figure errs heavy: gpt-oss-120b 65.90 GiB at TP1 against 65.97 logged
        # on Marlin (vllm#23278) and 64.38 on H100 (vllm#33155), 17.19 at TP4 against 17.22.
        return QuantScheme(
            "mxfp4",
            4,
            group_size=32,
            scale_bytes=1,
            ignore=kept,
            expert_padding=128,
            expert_hidden_padding=256,
        )
    if method == "bitsandbytes":
        if q.get("load_in_4bit"):
            double = bool(q.get("bnb_4bit_use_double_quant", False))
            # blocks of 64 weights with an fp32 absmax, or an 8-bit one after double quantisation
            return QuantScheme(
                "bitsandbytes-4bit", 4, group_size=64, scale_bytes=1.0 if double else 4.0, ignore=kept
            )
        if q.get("load_in_8bit"):
            return QuantScheme("bitsandbytes-8bit", 8, ignore=kept)
        raise UnknownQuantization("bitsandbytes config sets neither load_in_4bit nor load_in_8bit")
    raise UnknownQuantization(f"quantization method {method or '(none given)'!r} is not modelled")


def _compressed_tensors(q: Mapping[str, Any], kept: tuple[str, ...]) -> QuantScheme:
    groups = q.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise UnknownQuantization("compressed-tensors config has no config_groups")
    schemes: list[tuple[int, int, bool, tuple[str, ...]]] = []
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, Mapping) else None
        if not isinstance(w, Mapping):
            raise UnknownQuantization(f"compressed-tensors group {name!r} has no weights section")
        bits = _int(w, "num_bits")
        if bits not in (2, 3, 4, 8):
            raise UnknownQuantization(f"compressed-tensors group {name!r}: num_bits {bits!r} is not modelled")
        group = _int(w, "group_size") or 0
        targets = _names(g, "targets")
        schemes.append((bits, group, bool(w.get("symmetric", True)), targets))
    # several groups: size every quantised module at the widest (a safe over-count)
    bits, group, symmetric, _ = max(schemes, key=lambda s: (s[0], -s[1]))
    fmt = str(q.get("format", "")).lower()
    scale = 2.0 if group else 0.0
    zero = 0.0 if symmetric or not group else bits / 8
    method = f"compressed-tensors-{'fp' if 'float' in fmt else 'w'}{bits}"
    # targets are class names ("Linear") or module patterns; only patterns restrict the scheme
    patterns = tuple(t for s in schemes for t in s[3] if t.startswith("re:") or "." in t)
    return QuantScheme(
        method, bits, group_size=group, scale_bytes=scale, zero_bytes=zero, ignore=kept, only=patterns
    )


def runtime_scheme(method: str) -> QuantScheme:
    """vLLM's `--quantization fp8` on an unquantised checkpoint: every Linear layer of the blocks
    in FP8 with per-tensor scales (embeddings and LM head stay 16-bit)."""
    if method not in RUNTIME_QUANTIZATION:
        raise UnknownQuantization(f"runtime quantization {method!r} is not one of {RUNTIME_QUANTIZATION}")
    return QuantScheme(method, 8)


def uniform_scheme(bits: int) -> QuantScheme:
    """Every Linear layer at `bits` (vLLM's --weight-dtype-like override, or a shape's plain
    quant_bits): 4 bits and under are group-quantised with a 16-bit scale and zero per 128."""
    if bits <= 4:
        return QuantScheme("uniform", bits, group_size=128, scale_bytes=2, zero_bytes=2)
    return QuantScheme("uniform", bits)
