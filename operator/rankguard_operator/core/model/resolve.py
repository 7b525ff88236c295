"""A service's model: its shape, where that comes from, and whether it may be planned from priors.

The one resolver (`resolve`, once per pass): in order of precedence `spec.model.shape` (a person's
explicit figures, layered on whatever else is known), `spec.model.configMap` (the edge reads the
ConfigMap and hands its document in), the `config.json` the agent read next to the weights vLLM
loaded (kept in `status.model` so it outlives its pods), then the built-in catalog, matched
case-insensitively on the last path part of the model name (`meta-llama/Llama-3.1-70B-Instruct`
-> `llama-3.1-70b`). A model that none of them knows, or whose architecture, quantisation or
serving features the planner does not model, goes MEASURE-FIRST: vLLM profiles it at a bounded
utilisation, and the budget follows from the engine's per-worker report and the agents' NVML
figures. The `ModelResolved` condition says which, and why. What the model makes of the spec (a
split its heads cannot take, a quantisation on top of a quantised checkpoint) is refused here
as a `SpecError` naming the field.

`resolve_model` is the same precedence for figures alone (`rankguard plan --model/--config/--shape`).
Catalog figures are the published `config.json` values of each model (core/model/catalog).

Pure: no I/O (reading the file or ConfigMap is the caller's job).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from rankguard_operator.core.engine.rules import rules_for_image
from rankguard_operator.core.engine.surface import measure_first_reasons
from rankguard_operator.core.model.catalog import CATALOG, lookup_catalog
from rankguard_operator.core.model.checkpoint import CheckpointError, parse_summary, summary_json
from rankguard_operator.core.model.hf_config import canonical_json, relevant_config, shape_from_hf_config
from rankguard_operator.core.model.shape import InvalidShapeError, ModelError, ModelShape, UnknownModelError
from rankguard_operator.core.spec.crd import SHAPE_OVERRIDE_KEYS
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec

# ---------------------------------------------------------------------------------------------
# A shape from figures: spec.model.shape / --shape over a config.json over the catalog

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


def check_split(shape: ModelShape, tp: int, pp: int) -> None:
    """vLLM's constraints between the model and the GPU split, as SpecErrors naming spec fields."""
    if shape.num_heads % tp != 0:
        raise SpecError(
            f"spec.tensorParallelSize ({tp}) must divide the {shape.num_heads} attention heads of "
            f"{shape.name!r}: vLLM splits heads evenly across ranks"
        )
    kv = shape.num_kv_heads
    if kv % tp != 0 and tp % kv != 0:
        raise SpecError(
            f"spec.tensorParallelSize ({tp}) and the {kv} KV heads of {shape.name!r} must divide one "
            "another: vLLM splits KV heads across ranks, or replicates them when there are fewer"
        )
    if pp > shape.num_layers:
        raise SpecError(
            f"spec.pipelineParallelSize ({pp}) exceeds the {shape.num_layers} layers of {shape.name!r}; "
            "each pipeline stage needs at least one layer"
        )


# ---------------------------------------------------------------------------------------------
# The documents that describe a model: a ConfigMap's config.json, what an agent read

MAX_CONFIG_JSON = 64 * 1024  # the part of a config.json the planner reads is ~2 KiB


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
    # The shape the spec alone names (its figures or the catalog), known before any config.json is
    # read: the agent's probe is sized from it until there is a plan, so the rendered pod does
    # not change (and roll) when a config.json arrives.
    spec_shape: ModelShape | None = None

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
    """What the spec's extraArgs turn on that the planner does not model (core/engine/surface),
    read the way the image's vLLM reads them (`--no-enable-lora` turns nothing on)."""
    return "; ".join(measure_first_reasons(spec.engine.extra_args, rules_for_image(spec.image).cli))


# ---------------------------------------------------------------------------------------------
# The resolution, once per pass


def _spec_shape(spec: ServiceSpec) -> ModelShape | None:
    """The shape the spec alone names (spec.model.shape over the catalog), before any config.json
    is read; None for a ConfigMap's model or one the catalog does not know. An impossible shape
    or split is the spec's own mistake: a SpecError, whatever is read later."""
    m = spec.model
    if m.config_map is not None:
        return None
    try:
        shape = resolve_model(m.name, m.shape)
    except UnknownModelError:
        return None
    except ModelError as exc:
        raise SpecError(f"spec.model: {exc}") from None
    check_split(shape, spec.tp, spec.pp)
    return shape


def _config_doc(
    spec: ServiceSpec, config_map: ConfigRead | None, learned: LearnedModel | None
) -> tuple[Mapping[str, Any] | None, str, str]:
    """The config.json to read and where it came from, or why there is none yet: (document,
    source, problem). A ConfigMap named by the spec is the only source then, read or not; else
    what the agent read; an explicit shape with no document is the spec's own figures."""
    m = spec.model
    doc: Mapping[str, Any] | None = None
    source, problem = "catalog", ""
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
    return doc, source, problem


def _shape_of(
    spec: ServiceSpec, doc: Mapping[str, Any] | None, source: str, spec_shape: ModelShape | None
) -> tuple[ModelShape | None, str, str]:
    """The shape from the document (or the spec alone when there is none): (shape, source,
    problem). A document that cannot be read is a problem (measure-first), not a SpecError."""
    m = spec.model
    if doc is None and spec_shape is not None:
        return spec_shape, source, ""
    if doc is None:
        problem = (
            f"model {m.name!r} is not in rankguard's catalog and no config.json has been read yet; the "
            "agent reads it from the serving pod once vLLM has fetched the model"
        )
        return None, "none", problem
    try:
        return resolve_model(m.name, m.shape, hf_config=doc), source, ""
    except ModelError as exc:
        return None, source, f"the model's config.json (from {source}) cannot be read: {exc}"


def _check_against_spec(shape: ModelShape, spec: ServiceSpec) -> None:
    """The spec's own mistakes about this model: a split it cannot take, a runtime quantisation
    on top of a quantised checkpoint (SpecError)."""
    check_split(shape, spec.tp, spec.pp)
    if spec.model.quantization is not None and shape.quant is not None:
        raise SpecError(
            f"spec.model.quantization is {spec.model.quantization!r} but the checkpoint is already "
            f"quantised ({shape.quant.describe()}); remove spec.model.quantization"
        )


def _fitting_checkpoint(shape: ModelShape | None, learned: LearnedModel | None) -> Any:
    """The agent's header summary when it fits the shape (else None: weights from config.json)."""
    if shape is None or learned is None or learned.checkpoint_doc() is None:
        return None
    try:
        parse_summary(learned.checkpoint_doc(), shape.num_layers)
    except CheckpointError:
        return None
    return learned.checkpoint_doc()


def _resolution_message(reason: str, shape: ModelShape | None, source: str, checkpoint: Any) -> str:
    """The ModelResolved condition's message: why measure-first, or where the plan's figures come from."""
    if reason:
        return (
            f"{reason}; measure-first: vLLM profiles the model at a bounded gpu-memory-utilization and "
            "the per-GPU budget follows from its per-worker memory report and the agents' GPU figures"
        )
    assert shape is not None
    weights = "the checkpoint's headers" if checkpoint is not None else "config.json arithmetic"
    return f"planned from the {source} shape ({shape.architecture or 'dense'}); weights from {weights}"


def resolve(
    spec: ServiceSpec,
    config_map: ConfigRead | None = None,
    learned: LearnedModel | None = None,
) -> ModelResolution:
    """The shape to plan with and how it was found. Raises SpecError when the spec itself is
    wrong (an explicit shape that is impossible, a split the model cannot take)."""
    spec_shape = _spec_shape(spec)
    if learned is not None and learned.name and learned.name != spec.model.name:
        learned = None  # read for the model the spec named before: not this one's
    doc, source, problem = _config_doc(spec, config_map, learned)
    shape: ModelShape | None = None
    if not problem:
        shape, source, problem = _shape_of(spec, doc, source, spec_shape)
    if shape is not None:
        _check_against_spec(shape, spec)
    reason = problem or (shape.unmodelled if shape else "") or _unmodelled_options(spec)
    checkpoint = _fitting_checkpoint(shape, learned)
    return ModelResolution(
        shape=shape,
        source=source,
        reason=reason,
        message=_resolution_message(reason, shape, source, checkpoint),
        checkpoint=checkpoint,
        spec_shape=spec_shape,
    )


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
