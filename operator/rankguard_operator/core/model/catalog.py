"""The built-in catalog: published Hugging Face `config.json` files shipped with the operator.

Each `rankguard_operator/catalog/<owner>--<name>.json` holds one model's config.json as
published (under `config`) with where it was copied from (`catalog/SOURCES.md` lists them).
The catalog is those documents read by the same parser as any other config.json
(`hf_config.shape_from_hf_config`): one source of truth per model, no hand-typed shapes.
Keys are `catalog_key(repo)`: the last path part, lower case, with the vendor prefix and
fine-tune suffixes dropped, so `meta-llama/Llama-3.1-70B-Instruct` and
`meta-llama/Meta-Llama-3.1-70B` share `llama-3.1-70b`.

Reading the packaged files is the one I/O here, once, at import.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from importlib import resources
from typing import Any

from rankguard_operator.core.model.hf_config import shape_from_hf_config
from rankguard_operator.core.model.shape import ModelShape

# Suffixes that name a fine-tune or a packaging of the same architecture. Quantization
# suffixes (-awq, -gptq, -fp8) are deliberately NOT stripped: the weights differ in size,
# so such a model must come with its config.json (which says how it is quantized).
_VARIANT_SUFFIX = re.compile(r"-(instruct|chat|hf|base|it|v\d+\.\d+(\.\d+)*)$")


def catalog_key(name: str) -> str:
    """Normalise a model name for catalog lookup: last path part, lower case, vendor prefix and
    fine-tune suffixes removed (`meta-llama/Meta-Llama-3-70B-Instruct` -> `llama-3-70b`)."""
    key = name.strip().rstrip("/").rsplit("/", 1)[-1].lower()
    key = key.removeprefix("meta-")
    key = re.sub(r"^llama(\d)", r"llama-\1", key)  # "llama3-70b" is a common spelling
    while True:
        stripped = _VARIANT_SUFFIX.sub("", key)
        if stripped == key:
            return key
        key = stripped


def _load() -> tuple[dict[str, ModelShape], dict[str, Mapping[str, Any]]]:
    shapes: dict[str, ModelShape] = {}
    entries: dict[str, Mapping[str, Any]] = {}
    folder = resources.files("rankguard_operator") / "catalog"
    for item in sorted(folder.iterdir(), key=lambda p: p.name):
        if not item.name.endswith(".json"):
            continue
        entry = json.loads(item.read_text(encoding="utf-8"))
        config = dict(entry["config"])
        if "hf_quant_config" in entry:
            config["hf_quant_config"] = entry["hf_quant_config"]
        key = catalog_key(entry["repo"])
        shapes.setdefault(key, shape_from_hf_config(config, name=key))
        entries.setdefault(key, {**entry, "config": config})
    return shapes, entries


CATALOG, CATALOG_ENTRIES = _load()


def lookup_catalog(name: str) -> ModelShape | None:
    return CATALOG.get(catalog_key(name))
