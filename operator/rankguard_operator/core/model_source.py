"""Where a service's model shape comes from, and whether it may be planned from priors.

In order of precedence: `spec.model.shape` (a person's explicit figures, layered on whatever
else is known), `spec.model.configMap` (the edge reads the ConfigMap and hands its document
in), the `config.json` the agent read next to the weights vLLM loaded (kept in
`status.model` so it outlives its pods), then the built-in catalog. A model that none of them
knows, or whose architecture, quantisation or serving features the planner does not model,
goes MEASURE-FIRST: vLLM profiles it at a bounded utilisation, and the budget follows from
the engine's per-worker report and the agents' NVML figures. The `ModelResolved` condition
says which, and why. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rankguard_operator.core.checkpoint_weights import CheckpointError, parse_summary, summary_json
from rankguard_operator.core.engine.rules import rules_for_image
from rankguard_operator.core.hf_config import canonical_json, relevant_config
from rankguard_operator.core.model_shape import InvalidShapeError, ModelShape, UnknownModelError
from rankguard_operator.core.models import resolve_model
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec, check_split

MAX_CONFIG_JSON = 64 * 1024  # the part of a config.json the planner reads is ~2 KiB
# vLLM options whose memory the planner does not model: with one of them the service is
# measured, not planned (a draft model's weights and KV, LoRA adapters' slots).
UNMODELLED_OPTIONS = {
    "speculative_config": "speculative decoding (a draft model or MTP layers) is not modelled",
    "enable_lora": "LoRA adapters are not modelled",
    "kv_transfer_config": "a KV connector (e.g. LMCache) holds GPU memory that is not modelled",
}


@dataclass(frozen=True)
class ConfigRead:
    """What the edge found for spec.model.configMap: the parsed document, or why not."""

    doc: Mapping[str, Any] | None = None
    error: str | None = None


MAX_CONFIGMAP_ENTRY = 256 * 1024  # a config.json is a few KiB; refuse what cannot be one


def config_from_configmap(cm: Mapping[str, Any] | None, name: str, key: str) -> ConfigRead:
    """The config.json a ConfigMap holds under `key`, or a sentence saying what is wrong."""
    if cm is None:
        return ConfigRead(error=f"ConfigMap {name!r} (spec.model.configMap) does not exist in this namespace")
    data = cm.get("data") or {}
    text = data.get(key) if isinstance(data, Mapping) else None
    if not isinstance(text, str):
        keys = ", ".join(sorted(data)) if isinstance(data, Mapping) and data else "none"
        return ConfigRead(error=f"ConfigMap {name!r} has no key {key!r} (its keys: {keys})")
    if len(text) > MAX_CONFIGMAP_ENTRY:
        return ConfigRead(
            error=f"ConfigMap {name!r} key {key!r} is {len(text)} bytes, over {MAX_CONFIGMAP_ENTRY}"
        )
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return ConfigRead(error=f"ConfigMap {name!r} key {key!r} is not JSON: {exc}")
    if not isinstance(doc, Mapping):
        return ConfigRead(error=f"ConfigMap {name!r} key {key!r} must hold a JSON object (a config.json)")
    return ConfigRead(doc=doc)


@dataclass(frozen=True)
class LearnedModel:
    """What an agent read from the serving pod (status.model): config.json's relevant part
    and the checkpoint's header summary, both as compact JSON text."""

    config: str | None = None
    checkpoint: str | None = None
    name: str = ""  # spec.model.name it was read for: another model's files never count

    @classmethod
    def from_status(cls, doc: Any) -> LearnedModel | None:
        if not isinstance(doc, Mapping):
            return None
        cfg, ckpt, name = doc.get("config"), doc.get("checkpoint"), doc.get("name")
        cfg = cfg if isinstance(cfg, str) and len(cfg) <= MAX_CONFIG_JSON else None
        ckpt = ckpt if isinstance(ckpt, str) else None
        return cls(cfg, ckpt, name if isinstance(name, str) else "") if cfg or ckpt else None

    def config_doc(self) -> Mapping[str, Any] | None:
        try:
            doc = json.loads(self.config) if self.config else None
        except ValueError:
            return None
        return doc if isinstance(doc, Mapping) else None

    def checkpoint_doc(self) -> Any:
        try:
            return json.loads(self.checkpoint) if self.checkpoint else None
        except ValueError:
            return None


@dataclass(frozen=True)
class ModelResolution:
    shape: ModelShape | None  # None: nothing describes the model yet
    source: str  # shape | configMap | agent | catalog | none
    reason: str  # why measure-first ("" when planned from the shape)
    message: str  # the ModelResolved condition's message
    checkpoint: Any = None  # the agent's header summary when it fits the shape

    @property
    def measure_first(self) -> bool:
        return bool(self.reason)

    @property
    def plan_shape(self) -> ModelShape | None:
        """The shape to plan from priors: only a modelled one."""
        return None if self.measure_first else self.shape

    def condition(self) -> tuple[str, str, str]:
        """(status, reason, message) of the ModelResolved condition."""
        if not self.measure_first:
            return "True", "Planned", self.message
        return "False", "MeasureFirst", self.message

    def to_status(self, learned: LearnedModel | None) -> dict[str, Any]:
        s = self.shape
        out: dict[str, Any] = {
            "source": self.source,
            "modelled": not self.measure_first,
            "reason": self.reason or None,
            "architecture": (s.architecture or None) if s else None,
            "weightsFrom": "checkpoint" if self.checkpoint is not None else ("config" if s else None),
            "name": learned.name if learned and learned.name else None,
            "config": learned.config if learned else None,
            "checkpoint": learned.checkpoint if learned else None,
        }
        if s is not None:
            d = s.describe()
            out["params"] = d["params"]
            out["attention"] = d["attention"]
        return out


def learned_from_report(
    config: Mapping[str, Any] | None, checkpoint: Mapping[str, Any] | None, name: str = ""
) -> LearnedModel | None:
    """What an agent's report says about the model, reduced and bounded for status (or None)."""
    cfg = None
    if isinstance(config, Mapping):
        text = canonical_json(relevant_config(config))
        cfg = text if len(text) <= MAX_CONFIG_JSON else None
    ckpt = None
    if isinstance(checkpoint, Mapping):
        try:
            ckpt = summary_json(checkpoint)
        except CheckpointError:
            ckpt = None
    return LearnedModel(cfg, ckpt, name) if cfg or ckpt else None


def _unmodelled_options(spec: ServiceSpec) -> str:
    """What the spec's extraArgs turn on that the planner does not model, read the way the
    image's vLLM reads them (`--no-enable-lora` turns nothing on)."""
    cli = rules_for_image(spec.image).cli
    found: list[str] = []
    for _, word in cli.walk(spec.engine.extra_args)[0]:
        o = word.option
        if (
            o is not None
            and o.dest in UNMODELLED_OPTIONS
            and not word.key.startswith(("--no-", "--disable-"))
        ):
            found.append(UNMODELLED_OPTIONS[o.dest])
    return "; ".join(dict.fromkeys(found))


def resolve(
    spec: ServiceSpec,
    config_map: ConfigRead | None = None,
    learned: LearnedModel | None = None,
) -> ModelResolution:
    """The shape to plan with and how it was found. Raises SpecError when the spec itself is
    wrong (an explicit shape that is impossible, a split the model cannot take)."""
    m = spec.model
    doc: Mapping[str, Any] | None = None
    source = "catalog"
    problem = ""
    if learned is not None and learned.name and learned.name != m.name:
        learned = None  # read for the model the spec named before: not this one's
    if m.config_map is not None:
        source = "configMap"
        if config_map is None or config_map.doc is None:
            problem = (config_map.error if config_map else None) or (
                f"ConfigMap {m.config_map!r} has not been read yet"
            )
        else:
            doc = config_map.doc
    elif learned is not None and learned.config_doc() is not None:
        doc, source = learned.config_doc(), "agent"
    if m.shape:
        source = "shape" if doc is None else source
    try:
        shape: ModelShape | None = resolve_model(m.name, m.shape, hf_config=doc) if not problem else None
    except UnknownModelError:
        shape = None
        problem = (
            f"model {m.name!r} is not in rankguard's catalog and no config.json has been read yet; the "
            "agent reads it from the serving pod once vLLM has fetched the model"
        )
        source = "none"
    except InvalidShapeError as exc:
        if source == "shape" or (m.shape and doc is None):
            raise SpecError(f"spec.model: {exc}") from None
        shape, problem = None, f"the model's config.json (from {source}) cannot be read: {exc}"
    if shape is not None:
        check_split(shape, spec.tp, spec.pp)
        if spec.model.quantization is not None and shape.quant is not None:
            raise SpecError(
                f"spec.model.quantization is {spec.model.quantization!r} but the checkpoint is already "
                f"quantised ({shape.quant.describe()}); remove spec.model.quantization"
            )
    reason = problem or (shape.unmodelled if shape else "") or _unmodelled_options(spec)
    checkpoint = None
    if shape is not None and learned is not None and learned.checkpoint_doc() is not None:
        try:
            parse_summary(learned.checkpoint_doc(), shape.num_layers)
            checkpoint = learned.checkpoint_doc()
        except CheckpointError:
            checkpoint = None
    if reason:
        message = (
            f"{reason}; measure-first: vLLM profiles the model at a bounded gpu-memory-utilization and "
            "the per-GPU budget follows from its per-worker memory report and the agents' GPU figures"
        )
    else:
        assert shape is not None
        weights = "the checkpoint's headers" if checkpoint is not None else "config.json arithmetic"
        message = f"planned from the {source} shape ({shape.architecture or 'dense'}); weights from {weights}"
    return ModelResolution(shape=shape, source=source, reason=reason, message=message, checkpoint=checkpoint)


def model_event(
    previous: Any, model: ModelResolution
) -> tuple[Literal["Normal", "Warning"], str, str] | None:
    """The Event to post when how the model is known changes (`previous` is status.model as
    stored): once when a service goes measure-first (or for another reason), once when it
    becomes planned after that or from a new source. A catalog model planned from the first
    pass says so in its condition alone."""
    prev = previous if isinstance(previous, Mapping) else {}
    if model.measure_first:
        if prev.get("reason") != model.reason:
            return "Warning", "ModelMeasureFirst", model.message
        return None
    if prev and (prev.get("modelled") is False or prev.get("source") != model.source):
        return "Normal", "ModelResolved", model.message
    return None
