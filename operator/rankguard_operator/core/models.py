"""Model shapes: the few numbers of a transformer that decide where GPU memory goes.

Three ways to get a `ModelShape`, in the order `resolve_model` prefers them:

1. an explicit override (the CRD's `spec.model.shape`, camelCase keys, or `rankguard plan
   --shape KEY=VALUE`), complete on its own or layered on top of 2/3;
2. a Hugging Face `config.json` (`shape_from_hf_config`; in a cluster without internet it
   comes from the ConfigMap named in `spec.model.configMap`, on the CLI from `--config`);
3. the built-in catalog, matched case-insensitively on the last path part of the model name
   (`meta-llama/Llama-3.1-70B-Instruct` -> `llama-3.1-70b`).

Catalog figures are the published `config.json` values of each model; the ones also listed in
`shared/reference/vllm-memory-facts.md` (Llama-3-8B/70B, Llama-3.1-405B, Mixtral-8x7B) match
that table. Pure: no I/O (reading the file or ConfigMap is the caller's job).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from rankguard_operator.core.catalog import CATALOG, lookup_catalog
from rankguard_operator.core.hf_config import shape_from_hf_config
from rankguard_operator.core.model_shape import (
    InvalidShapeError,
    ModelShape,
    UnknownModelError,
)
from rankguard_operator.core.spec.crd import SHAPE_OVERRIDE_KEYS

# ---------------------------------------------------------------------------------------------
# Overrides (CRD spec.model.shape / CLI --shape): camelCase key -> ModelShape field

# The keys a shape needs when there is nothing (catalog entry or config.json) to fill gaps from.
REQUIRED_OVERRIDE_KEYS: tuple[str, ...] = (
    "vocabSize",
    "hiddenSize",
    "numLayers",
    "numHeads",
    "numKVHeads",
    "intermediateSize",
)


def _what_to_provide() -> str:
    optional = [k for k in SHAPE_OVERRIDE_KEYS if k not in REQUIRED_OVERRIDE_KEYS]
    return (
        f"provide spec.model.shape with {', '.join(REQUIRED_OVERRIDE_KEYS)} "
        f"(optional: {', '.join(optional)}), or spec.model.configMap naming a ConfigMap that holds the "
        "model's config.json; on the command line use --config path/to/config.json or --shape KEY=VALUE"
    )


def resolve_model(
    name: str,
    override: Mapping[str, Any] | None = None,
    *,
    hf_config: Mapping[str, Any] | None = None,
) -> ModelShape:
    """The shape to plan with for `name`.

    Precedence: `override` keys win over `hf_config`, which wins over the catalog. An override
    alone must be complete (`REQUIRED_OVERRIDE_KEYS`). Raises `UnknownModelError` (message
    says exactly what to provide) or `InvalidShapeError`.
    """
    base = shape_from_hf_config(hf_config, name=name) if hf_config is not None else lookup_catalog(name)
    if not override:
        if base is None:
            raise UnknownModelError(
                f"unknown model {name!r}: rankguard has no built-in shape for it "
                f"(built-in: {', '.join(sorted(CATALOG))}); {_what_to_provide()}"
            )
        return replace(base, name=name) if base.name != name else base
    unknown = sorted(set(override) - set(SHAPE_OVERRIDE_KEYS))
    if unknown:
        raise InvalidShapeError(
            f"model {name!r}: unknown shape field(s) {', '.join(unknown)}; "
            f"accepted: {', '.join(SHAPE_OVERRIDE_KEYS)}"
        )
    values = {SHAPE_OVERRIDE_KEYS[k]: v for k, v in override.items() if v is not None}
    if base is None:
        missing = [k for k in REQUIRED_OVERRIDE_KEYS if SHAPE_OVERRIDE_KEYS[k] not in values]
        if missing:
            raise UnknownModelError(
                f"unknown model {name!r} and the shape given is incomplete: missing {', '.join(missing)}; "
                f"{_what_to_provide()}"
            )
        if "head_dim" not in values:
            values["head_dim"] = 0
        return ModelShape(name=name, **values)
    # head_dim of the base was derived from its hidden/heads; re-derive when those change
    if "head_dim" not in values and ("hidden_size" in values or "num_heads" in values):
        values["head_dim"] = 0
    return replace(base, name=name, **values)
