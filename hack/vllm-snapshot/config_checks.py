"""The refusals vLLM makes when it builds a model's configuration, read out of the installed package.

Imported by snapshot.py (runs INSIDE the venv with the real vLLM). Writes `config_checks.json`,
what the sandbox's fake vLLM refuses when its `create_engine_config` runs (the pod's judge,
agent/rankguard_agent/engine_judge.py, and its own start-up), so it judges as the release does:

- `model_runner`: `ModelConfig`'s check of `--runner`/`--convert` against what the model's
  architecture is (generative, pooling): rankguard's static layer has no model registry, so this
  refusal reaches the pod. `sources`: the templates in vllm/config/model.py (file:line), found by
  the fragment below; `architectures`: for each text-only architecture of the operator's catalog
  (operator/rankguard_operator/catalog, one config.json each), the message the real ModelConfig
  raises for every `--runner` x `--convert` pair it refuses (rendered by vLLM itself: the
  ValueError inside pydantic's ValidationError), pairs it takes left out. A pair whose
  ModelConfig fails for another reason (a multimodal processor it cannot load offline, ...) is
  left out too: the fake accepts what the record does not refuse.
"""

from __future__ import annotations

import ast
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from templates import literals, template

MODEL_SOURCE = "vllm/config/model.py"
# Search keys (not the messages: those are read from the source and rendered by vLLM).
RUNNER_FRAGMENT = "support `--runner "
RUNNERS = ("auto", "generate", "pooling", "draft")
CONVERTS = ("auto", "none", "embed", "classify")
MULTIMODAL_KEYS = ("text_config", "vision_config")
CATALOG = Path(__file__).resolve().parents[2] / "operator" / "rankguard_operator" / "catalog"


def runner_sources(site: Path) -> list[dict[str, Any]]:
    tree = ast.parse((site / MODEL_SOURCE).read_text(encoding="utf-8"))
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    found = []
    for lineno, node in literals(tree):
        t = None if id(node) in inner else template(node)
        if t is not None and RUNNER_FRAGMENT in t[1]:
            style, text, exprs = t
            found.append(
                {"file": MODEL_SOURCE, "line": lineno, "style": style, "template": text, "exprs": exprs}
            )
    if not found:
        sys.exit(f"snapshot: no {RUNNER_FRAGMENT!r} in {MODEL_SOURCE}; re-read the model checks")
    return sorted(found, key=lambda e: e["line"])


def _catalog_configs() -> dict[str, dict[str, Any]]:
    """One config.json per text-only architecture (the first catalog entry naming it): a
    multimodal one (a nested text/vision config) needs its processor, which offline it lacks."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(CATALOG.glob("*.json")):
        config = json.loads(path.read_text(encoding="utf-8")).get("config") or {}
        if any(key in config for key in MULTIMODAL_KEYS):
            continue
        for arch in config.get("architectures") or ():
            out.setdefault(arch, config)
    return out


def _refusal(exc: BaseException) -> str:
    """vLLM's own text: the ValueError a pydantic ValidationError wraps, or the error itself."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        for err in errors():
            inner = (err.get("ctx") or {}).get("error")
            if inner is not None:
                return str(inner)
    return str(exc)


def model_runner(site: Path) -> dict[str, Any]:
    from vllm.config import ModelConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sources = runner_sources(site)
    heads = [s["template"].split("{", 1)[0] for s in sources]
    architectures: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch, config in _catalog_configs().items():
            folder = Path(tmp) / arch
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
            refused: dict[str, str] = {}
            for runner in RUNNERS:
                for convert in CONVERTS:
                    try:
                        ModelConfig(
                            model=str(folder), runner=runner, convert=convert, skip_tokenizer_init=True
                        )
                    except Exception as e:  # only the runner checks' refusals are kept
                        text = _refusal(e)
                        if any(text.startswith(h) for h in heads):
                            refused[f"{runner}/{convert}"] = text
            architectures[arch] = refused
    return {"sources": sources, "architectures": architectures}


def config_checks(site: Path) -> dict[str, Any]:
    return {"model_runner": model_runner(site)}
