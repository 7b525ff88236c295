"""Record the defaults of the config fields rankguard reads for multimodal checkpoints, per `model_type`.

    VLLM_TARGET_DEVICE=cpu ~/.cache/rankguard/vllm-0.33.0/bin/python hack/vllm-snapshot/arch_defaults.py \
        operator/rankguard_operator/vllm_snapshots/0.33.0/arch_defaults.json

Runs INSIDE the venv that has the real `vllm` installed (see run.sh); nothing is started. A published
`config.json` leaves out the fields its architecture's config class fills in (google/gemma-3-*-it
states no `vocab_size`), and transformers then uses the class's value. So each class below is
instantiated with no arguments, as transformers does for a missing field, and the named fields are
read off the instance after `__init__` (a computed field thus gets its computed value). The classes
are transformers' (the version vLLM ships with, recorded) or, for a type transformers lacks, vLLM's.

A field the class keeps only as a backward-compatible private attribute (`_name`: transformers 5
turned Gemma 3's `sliding_window_pattern` into `layer_types` and keeps the old int as
`_sliding_window_pattern`) is read from there and listed under `private`. A field found nowhere, or a
class whose `model_type` is not the key, stops the script with its name: re-read the class, never guess.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys
from pathlib import Path
from typing import Any

from cpu_build import release_meta  # this folder (the script's own directory is on sys.path)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# model_type -> (the config class, "module.Class"; the fields rankguard's hf_config / vision read)
# a vision tower's size, as its config class states it (SigLIP's, Llama 4's)
_TOWER = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "image_size",
    "patch_size",
    "num_channels",
)
FIELDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma3_text": (
        "transformers.models.gemma3.configuration_gemma3.Gemma3TextConfig",
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "tie_word_embeddings",
            "sliding_window",
            "sliding_window_pattern",
            "max_position_embeddings",
            "attention_bias",
        ),
    ),
    # the wrapper: its own tie (the fallback when neither it nor its text_config states one)
    "gemma3": (
        "transformers.models.gemma3.configuration_gemma3.Gemma3Config",
        ("tie_word_embeddings", "mm_tokens_per_image"),
    ),
    "siglip_vision_model": (
        "transformers.models.siglip.configuration_siglip.SiglipVisionConfig",
        _TOWER,
    ),
    "llama4_text": (
        "transformers.models.llama4.configuration_llama4.Llama4TextConfig",
        (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "intermediate_size_mlp",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "tie_word_embeddings",
            "num_local_experts",
            "num_experts_per_tok",
            "interleave_moe_layer_step",
            "attention_chunk_size",
            "max_position_embeddings",
            "attention_bias",
        ),
    ),
    "llama4": ("transformers.models.llama4.configuration_llama4.Llama4Config", ("tie_word_embeddings",)),
    "llama4_vision_model": (
        "transformers.models.llama4.configuration_llama4.Llama4VisionConfig",
        (
            *_TOWER,
            "vision_output_dim",
            "projector_input_dim",
            "projector_output_dim",
        ),
    ),
    # Kimi-VL's tower: transformers has no MoonViT, vLLM carries its config class
    "moonvit": (
        "vllm.transformers_utils.configs.moonvit.MoonViTConfig",
        (
            "patch_size",
            "init_pos_emb_height",
            "init_pos_emb_width",
            "num_attention_heads",
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "merge_kernel_size",
        ),
    ),
}
_MISSING = object()


def _class(dotted: str) -> type[Any]:
    module, _, name = dotted.rpartition(".")
    cls: type[Any] = getattr(importlib.import_module(module), name)
    return cls


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, tuple):
        value = list(value)  # MoonViT's merge_kernel_size is a tuple; JSON has lists
    try:
        json.dumps(value)
    except TypeError as e:
        raise SystemExit(f"{where}: not a JSON value ({e})") from None
    return value


def read_defaults() -> dict[str, Any]:
    defaults: dict[str, dict[str, Any]] = {}
    classes: dict[str, str] = {}
    private: dict[str, dict[str, str]] = {}
    for model_type, (dotted, fields) in FIELDS.items():
        cls = _class(dotted)
        instance = cls()  # no arguments: what transformers builds for a config.json missing every field
        if instance.model_type != model_type:
            raise SystemExit(f"{dotted}().model_type is {instance.model_type!r}, not {model_type!r}")
        classes[model_type] = f"{cls.__module__}.{cls.__qualname__}"
        found: dict[str, Any] = {}
        for field in fields:
            value = getattr(instance, field, _MISSING)
            if value is _MISSING:
                value = getattr(instance, "_" + field, _MISSING)
                if value is _MISSING:
                    raise SystemExit(f"{dotted}() has no field {field!r} (nor '_{field}'): re-read the class")
                private.setdefault(model_type, {})[field] = "_" + field
            found[field] = _json_value(value, f"{dotted}().{field}")
        defaults[model_type] = found
    return {"classes": classes, "defaults": defaults, "private": private}


def main() -> None:
    dest = Path(sys.argv[1])
    doc = {
        **release_meta(),  # vllm_version (the CPU build's is VERSION+cpu) and generated_by
        "transformers": importlib.metadata.version("transformers"),
        **read_defaults(),
    }
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {dest}: {len(doc['defaults'])} model types")


if __name__ == "__main__":
    main()
