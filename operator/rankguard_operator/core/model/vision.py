"""Nested-config defaults and a multimodal checkpoint's vision tower, split vs whole per TP rank.

A published `config.json` of a multimodal model leaves out the fields its architecture's config
class fills in (google/gemma-3-*-it states no `vocab_size`; a Llama 4 file may state no
`vision_config`). `ARCH_DEFAULTS` holds those defaults by `model_type`: the recorded vLLM snapshot's
`arch_defaults.json` (rankguard_operator/vllm_snapshots/), read out of the config classes of the
transformers vLLM ships with (or, for types transformers lacks, vLLM's own) by
`hack/vllm-snapshot/run.sh 0.33.0` (`hack/vllm-snapshot/arch_defaults.py`), never typed by hand.

`vision_tower` sizes a tower and its projector and says which part vLLM 0.33 keeps WHOLE on
every TP rank under the default `mm_encoder_tp_mode="weights"` (the encoder blocks' attention
and MLP are Column/RowParallel; patch and position embeddings, norms and some projectors are
not). A family read here without its vLLM model checked is counted whole on every rank (safe).
Pure: no I/O (the defaults come from the recorded vLLM snapshot, package data read once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rankguard_operator import vllm_snapshots

# model_type -> the defaults of the fields rankguard reads (the snapshot names each config class)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = vllm_snapshots.latest().arch_defaults
# The nested configs' types when a file leaves `model_type` out of them
TEXT_TYPE = {"gemma3": "gemma3_text", "llama4": "llama4_text", "kimi_vl": "deepseek_v3"}
VISION_TYPE = {"gemma3": "siglip_vision_model", "llama4": "llama4_vision_model", "kimi_vl": "moonvit"}


def with_defaults(doc: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """`doc` with the fields it leaves out filled from its architecture's config class."""
    return {**ARCH_DEFAULTS.get(model_type, {}), **doc}


def _get(v: Mapping[str, Any], *keys: str, default: int = 0) -> int:
    for k in keys:
        x = v.get(k)
        if isinstance(x, int) and not isinstance(x, bool) and x > 0:
            return x
    return default


def vision_tower(
    outer_type: str, vision: Mapping[str, Any], outer: Mapping[str, Any], text_hidden: int
) -> tuple[int, int, int] | None:
    """(all parameters, those whole on every TP rank, the tower's attention heads) of a vision
    tower and its projector; None when the config does not state the tower's size."""
    layers = _get(vision, "depth", "num_hidden_layers")
    hv = _get(vision, "hidden_size", "embed_dim")
    if not layers or not hv:
        return None
    heads = _get(vision, "num_heads", "num_attention_heads")
    inter = _get(vision, "intermediate_size", default=4 * hv)
    patch = _get(vision, "patch_size", "spatial_patch_size", default=14)
    chans = _get(vision, "in_chans", "in_channels", "num_channels", default=3)
    temporal = _get(vision, "temporal_patch_size", default=1)
    out = _get(vision, "out_hidden_size", default=text_hidden)
    gated = outer_type in ("qwen2_5_vl", "mistral3")
    attn = 4 * hv * hv + 4 * hv
    mlp = (3 if gated else 2) * hv * inter
    norms = 4 * hv  # two LayerNorms (weight and bias) per block: replicated
    blocks_split = layers * (attn + mlp)
    patch_embed = chans * temporal * patch * patch * hv + hv
    if outer_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        # qwen2_5_vl.py / qwen3_vl.py: blocks and patch mergers are Column/RowParallel; the Conv3d
        # patch embedding, Qwen3's learned position table and the norms are whole
        merge = _get(vision, "spatial_merge_size", default=2)
        merged = hv * merge * merge
        mergers = 1 + len(vision.get("deepstack_visual_indexes") or [])  # Qwen3-VL's DeepStack
        split = blocks_split + mergers * (merged * merged + merged * out)
        whole = patch_embed + layers * norms + mergers * 2 * merged
        whole += _get(vision, "num_position_embeddings") * hv
    elif outer_type == "gemma3":
        # gemma3_mm.py + siglip.py: SigLIP blocks split; patch Conv2d, position table, norms and
        # the projector's mm_input_projection_weight (an nn.Parameter) are whole
        image = _get(vision, "image_size", default=224)
        split = blocks_split
        whole = patch_embed + (image // patch) ** 2 * hv + layers * norms + 2 * hv + hv * text_hidden + hv
    elif outer_type == "llama4":
        # mllama4.py: patch "unfold" linear, blocks, pixel-shuffle adapter MLP and projector are
        # Column/RowParallel; class and position embeddings and the norms are whole
        image = _get(vision, "image_size", default=448)
        proj_in = _get(vision, "projector_input_dim", default=4096)
        proj_out = _get(vision, "projector_output_dim", default=4096)
        split = (
            blocks_split
            + chans * patch * patch * hv
            + inter * proj_in
            + proj_in * proj_out
            + _get(vision, "vision_output_dim", default=proj_out) * text_hidden
        )
        whole = ((image // patch) ** 2 + 2) * hv + layers * norms + 4 * hv
    elif outer_type == "kimi_vl":
        # moonvit.py: blocks split; patch Conv2d, the learned 2-D position table and norms whole;
        # kimi_vl.py: the projector is two ReplicatedLinear layers, whole on every rank
        kernel = vision.get("merge_kernel_size") or [2, 2]
        merged = hv * int(kernel[0]) * int(kernel[1])
        pos = _get(vision, "init_pos_emb_height", default=64) * _get(vision, "init_pos_emb_width", default=64)
        split = blocks_split
        whole = patch_embed + pos * hv + layers * norms + 2 * hv
        whole += 2 * hv + merged * merged + merged + merged * text_hidden + text_hidden
    elif outer_type == "mistral3":
        # pixtral.py (HF Pixtral tower): blocks split; the patch Conv2d, norms and the patch
        # merger (an nn.Linear) whole; mistral3.py: projector Column/RowParallel
        merge = _get(outer, "spatial_merge_size", default=2)
        split = blocks_split + hv * text_hidden + text_hidden * text_hidden
        whole = patch_embed + layers * norms + 2 * hv + hv * merge * merge * hv + hv
    else:
        # a family whose vLLM model is not checked here: the tower counted whole on every rank
        merge = _get(vision, "spatial_merge_size", default=1)
        merged = hv * merge * merge
        projector = merged * merged + merged * out if merge > 1 else hv * out
        total = blocks_split + layers * norms + patch_embed + projector
        return total, total, 0
    return split + whole, whole, heads
