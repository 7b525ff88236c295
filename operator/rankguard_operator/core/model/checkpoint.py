"""Weight bytes per rank from the checkpoint's own safetensors headers (as the agent summarised them).

A safetensors file states every tensor's dtype and shape in its header, so the agent, which
sits next to the downloaded weights, can count a checkpoint's bytes exactly whatever its
quantisation format, without reading a tensor. It reports them by role (embeddings, LM head,
vision tower, the rest) and per decoder layer as three roles: `split` (sharded by TP), `kv`
(k/v projections: max(1, kv_heads // tp) of kv_heads per rank) and `replicated` (norms,
routers, MLA's down-projections); the vision role as `ModelShape.vision_params_per_rank`
says (whole on every rank unless the split is known). Each role is [float params, other
bytes]: 16/32-bit floats are counted as parameters so they can be sized at the serving dtype
(vLLM loads an fp32
checkpoint in 16-bit, and `--quantization fp8` turns a 16-bit Linear into 8-bit); quantised
payloads (int4 packed in int32, fp8, mxfp4 blocks, scales) keep their bytes.

Layers at or beyond the model's num_hidden_layers (DeepSeek's multi-token-prediction layer)
are not loaded by vLLM for serving and are left out. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rankguard_operator.core.model.shape import ModelShape

MAX_CHECKPOINT_JSON = 256 * 1024  # a 4096-layer summary is ~200 KiB; status keeps it
_MAX = 1 << 50

Pair = tuple[int, int]  # (float params, other bytes)


class CheckpointError(ValueError):
    """The summary cannot describe the checkpoint of this model."""


def _pair(v: Any, where: str) -> Pair:
    if (
        not isinstance(v, Sequence)
        or isinstance(v, str)
        or len(v) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _MAX for x in v)
    ):
        raise CheckpointError(f"{where} must be [float params, other bytes], got {v!r}")
    return int(v[0]), int(v[1])


def parse_summary(doc: Any, num_layers: int) -> tuple[dict[str, Pair], dict[int, tuple[Pair, Pair, Pair]]]:
    """Roles and the layers below `num_layers`, validated. Raises CheckpointError."""
    if not isinstance(doc, Mapping):
        raise CheckpointError("the checkpoint summary must be an object")
    roles_doc = doc.get("roles") or {}
    if not isinstance(roles_doc, Mapping):
        raise CheckpointError("checkpoint roles must be an object")
    roles = {str(k): _pair(v, f"role {k}") for k, v in roles_doc.items()}
    layers: dict[int, tuple[Pair, Pair, Pair]] = {}
    raw = doc.get("layers")
    if not isinstance(raw, list):
        raise CheckpointError("checkpoint layers must be a list")
    for row in raw:
        if (
            not isinstance(row, list)
            or len(row) != 4
            or not isinstance(row[0], int)
            or isinstance(row[0], bool)
        ):
            raise CheckpointError(f"a checkpoint layer must be [index, split, kv, replicated], got {row!r}")
        i = row[0]
        if 0 <= i < num_layers:
            layers[i] = (
                _pair(row[1], f"layer {i} split"),
                _pair(row[2], f"layer {i} kv"),
                _pair(row[3], f"layer {i} replicated"),
            )
    missing = [i for i in range(num_layers) if i not in layers]
    if missing:
        raise CheckpointError(
            f"the checkpoint has no tensors for {len(missing)} of the model's {num_layers} layers "
            f"(first: {missing[0]}); it does not match config.json"
        )
    return roles, layers


def _bytes(pair: Pair, act: int, share: float) -> int:
    return int((pair[0] * act + pair[1]) * share + 0.999)


def checkpoint_rank_weights(
    summary: Any,
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    stages: Sequence[int],
    act: int,
    runtime_fp8: bool = False,
) -> tuple[int, ...]:
    """Weight bytes of every global rank (pp_stage * tp + tp_rank). Raises CheckpointError when
    the summary does not fit the model (then config.json arithmetic is used)."""
    roles, layers = parse_summary(summary, shape.num_layers)
    kv_share = shape.kv_heads_per_rank(tp) / shape.num_kv_heads
    linear_act = 1 if runtime_fp8 else act  # --quantization fp8 stores 16-bit Linear weights in 8 bits
    zero = (0, 0)
    # the share of the vision tower one rank holds (whole on every rank: ModelShape says why)
    vision_share = shape.vision_params_per_rank(tp) / shape.vision_params if shape.vision_params else 1.0
    out: list[int] = []
    first = 0
    for stage, n in enumerate(stages):
        total = 0
        for i in range(first, first + n):
            split, kv, repl = layers[i]
            total += (
                _bytes(split, linear_act, 1 / tp) + _bytes(kv, linear_act, kv_share) + _bytes(repl, act, 1)
            )
        if stage == 0:
            total += _bytes(roles.get("embed", zero), act, 1 / tp) + _bytes(
                roles.get("vision", zero), act, vision_share
            )
        if stage == pp - 1:
            total += _bytes(roles.get("other", zero), act, 1)
            head = roles.get("head", zero)
            if head == zero and pp > 1:
                head = roles.get("embed", zero)  # a tied head is a second copy on the last stage
            total += _bytes(head, act, 1 / tp)
        out += [total] * tp
        first += n
    return tuple(out)


def summary_json(summary: Mapping[str, Any]) -> str:
    text = json.dumps(summary, sort_keys=True, separators=(",", ":"))
    if len(text) > MAX_CHECKPOINT_JSON:
        raise CheckpointError(f"the checkpoint summary is {len(text)} bytes, over {MAX_CHECKPOINT_JSON}")
    return text
