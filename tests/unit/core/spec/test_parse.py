"""ServiceSpec parsing: the CRD's defaults, every rule with its message, and drift against the CRD."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from rankguard_operator.core.model.resolve import ConfigRead, resolve
from rankguard_operator.core.spec.crd import (
    BLOCK_SIZES,
    DEFAULT_AGENT_PORT,
    DEFAULT_COOLDOWN_SECONDS,
    DEFAULT_HOST_MEMORY_BUMP_RATIO,
    DEFAULT_MAX_PER_HOUR,
    DEFAULT_MIN_HEADROOM_BYTES,
    DEFAULT_SAMPLE_HZ,
    DTYPES,
    KV_CACHE_DTYPES,
)
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB, MiB
from tests import REPO

CRD = REPO / "crds" / "llmservice.yaml"

MINIMAL: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-70B"},
    "image": "vllm/vllm-openai:v0.33.0",
}


def with_(path: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """MINIMAL (or `base`) with the dotted `path` set to `value`."""
    doc = copy.deepcopy(base if base is not None else MINIMAL)
    *parents, leaf = path.split(".")
    cur = doc
    for p in parents:
        cur = cur.setdefault(p, {})
    cur[leaf] = value
    return doc


def crd_spec_schema() -> dict[str, Any]:
    doc = yaml.safe_load(CRD.read_text())
    schema: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


# --- defaults -----------------------------------------------------------------------------------


def test_minimal_spec_gets_the_crd_defaults() -> None:
    s = parse_spec(MINIMAL)
    assert (s.model.name, s.image, s.replicas, s.tp, s.pp, s.world_size) == (
        "meta-llama/Meta-Llama-3-70B",
        "vllm/vllm-openai:v0.33.0",
        1,
        1,
        1,
        1,
    )
    e = s.engine
    assert (e.max_num_seqs, e.max_model_len, e.max_num_batched_tokens) == (256, None, 8192)
    assert (e.dtype, e.kv_cache_dtype, e.block_size, e.enforce_eager, e.logits_mode, e.extra_args) == (
        "auto",
        "auto",
        None,  # vLLM's choice
        False,
        "all-gather",
        (),
    )
    m = s.memory
    assert m.gpu_memory_utilization is None and m.kv_cache_memory_bytes is None and not m.pinned
    assert (m.safety_margin_bytes, m.min_headroom_bytes, m.reclaim, m.gpu_memory_bytes) == (
        512 * MiB,
        128 * MiB,
        True,
        None,
    )
    r = s.remediation
    assert (r.enabled, r.cooldown_seconds, r.max_per_hour, r.host_memory_bump_ratio) == (True, 300, 4, 1.2)
    assert r.min_kv_cache_bytes is None and r.max_kv_cache_bytes is None and r.max_host_memory_bytes is None
    assert (s.agent.image, s.agent.port, s.agent.probe, s.agent.sample_hz) == (None, 9404, True, 10.0)
    assert s.resources.memory_limit_bytes is None and s.resources.cpu_request is None


def test_full_spec_is_read_field_by_field() -> None:
    s = parse_spec(
        {
            "model": {"name": "meta-llama/Meta-Llama-3-70B"},
            "image": "vllm/vllm-openai:v0.33.0",
            "replicas": 3,
            "tensorParallelSize": 4,
            "pipelineParallelSize": 2,
            "engine": {
                "maxNumSeqs": 128,
                "maxModelLen": 8192,
                "maxNumBatchedTokens": 4096,
                "dtype": "bfloat16",
                "kvCacheDtype": "fp8",
                "blockSize": 32,
                "enforceEager": True,
                "logitsMode": "gather",
                "extraArgs": ["--enable-prefix-caching", "--served-model-name", "llama"],
            },
            "memory": {
                "gpuMemoryUtilization": 0.85,
                "safetyMarginBytes": 1 * GiB,
                "minHeadroomBytes": 512 * MiB,
                "reclaim": False,
                "gpuMemoryBytes": 80 * GiB,
            },
            "remediation": {
                "enabled": False,
                "cooldownSeconds": 60,
                "maxPerHour": 2,
                "minKVCacheBytes": 4 * GiB,
                "maxKVCacheBytes": 60 * GiB,
                "hostMemoryBumpRatio": 1.5,
                "maxHostMemory": "256Gi",
            },
            "resources": {
                "requests": {"cpu": 8, "memory": "64Gi"},
                "limits": {"cpu": "16", "memory": 137438953472},
            },
            "agent": {"image": "ghcr.io/x/agent:1", "port": 9500, "probe": False, "sampleHz": 20},
        }
    )
    assert (s.replicas, s.tp, s.pp, s.world_size) == (3, 4, 2, 8)
    assert s.engine.extra_args == ("--enable-prefix-caching", "--served-model-name", "llama")
    assert (s.engine.block_size, s.engine.kv_cache_dtype, s.engine.logits_mode) == (32, "fp8", "gather")
    assert s.memory.gpu_memory_utilization == 0.85 and s.memory.gpu_memory_bytes == 80 * GiB
    assert s.remediation.max_host_memory_bytes == 256 * GiB
    assert (s.remediation.min_kv_cache_bytes, s.remediation.max_kv_cache_bytes) == (4 * GiB, 60 * GiB)
    assert (s.resources.cpu_request, s.resources.cpu_limit) == ("8", "16")
    assert (s.resources.memory_request_bytes, s.resources.memory_limit_bytes) == (64 * GiB, 128 * GiB)
    assert (s.agent.image, s.agent.port, s.agent.probe, s.agent.sample_hz) == (
        "ghcr.io/x/agent:1",
        9500,
        False,
        20.0,
    )


def test_pinned_budget_is_marked_pinned() -> None:
    s = parse_spec(with_("memory", {"kvCacheMemoryBytes": 30 * GiB}))
    assert s.memory.pinned and s.memory.kv_cache_memory_bytes == 30 * GiB


# --- every rule, with the words a person needs -------------------------------------------------

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("not an object", {"model": "llama"} | {"image": "x"}, "spec.model must be an object"),
    ("no model", {"image": "x"}, "spec.model is required"),
    ("no image", {"model": {"name": "meta-llama/Meta-Llama-3-70B"}}, "spec.image is required"),
    ("empty name", with_("model.name", ""), "spec.model.name"),
    (
        "bad quantization",
        with_("model.quantization", "awq"),
        "spec.model.quantization 'awq' is not one of fp8",
    ),
    ("tp too big", with_("tensorParallelSize", 65), "between 1 and 64"),
    ("gpus per replica", with_("pipelineParallelSize", 16, with_("tensorParallelSize", 8)), "at most 64"),
    ("tp vs heads", with_("tensorParallelSize", 3), "must divide the 64 attention heads"),
    (
        "tp vs kv heads",
        with_(
            "model.shape",
            {
                "vocabSize": 32000,
                "hiddenSize": 6144,
                "numLayers": 40,
                "numHeads": 48,
                "numKVHeads": 12,
                "intermediateSize": 16384,
            },
            with_("tensorParallelSize", 8, with_("model.name", "acme/odd-heads")),
        ),
        "12 KV heads",
    ),
    (
        "pp vs layers",
        with_("pipelineParallelSize", 64, with_("model.name", "meta-llama/Meta-Llama-3-8B")),
        "32 layers",
    ),
    ("replicas negative", with_("replicas", -1), "spec.replicas must be between 0 and 1000"),
    ("replicas as string", with_("replicas", "2"), "spec.replicas must be an integer"),
    ("bool as int", with_("tensorParallelSize", True), "must be an integer"),
    ("util and kv", with_("memory", {"gpuMemoryUtilization": 0.9, "kvCacheMemoryBytes": GiB}), "not both"),
    ("util zero", with_("memory", {"gpuMemoryUtilization": 0}), "above 0"),
    ("util high", with_("memory", {"gpuMemoryUtilization": 0.995}), "between 0 and 0.99"),
    (
        "headroom > margin",
        with_("memory", {"minHeadroomBytes": GiB, "safetyMarginBytes": 512 * MiB}),
        "must not exceed",
    ),
    (
        "kv >= gpu",
        with_("memory", {"kvCacheMemoryBytes": 80 * GiB, "gpuMemoryBytes": 80 * GiB}),
        "smaller than",
    ),
    (
        "floor > ceiling",
        with_("remediation", {"minKVCacheBytes": 2 * GiB, "maxKVCacheBytes": GiB}),
        "the floor",
    ),
    (
        "pinned below floor",
        with_("remediation", {"minKVCacheBytes": 2 * GiB}, with_("memory", {"kvCacheMemoryBytes": GiB})),
        "below spec.remediation.minKVCacheBytes",
    ),
    (
        "pinned above ceiling",
        with_("remediation", {"maxKVCacheBytes": GiB}, with_("memory", {"kvCacheMemoryBytes": 2 * GiB})),
        "above spec.remediation.maxKVCacheBytes",
    ),
    ("bump ratio", with_("remediation", {"hostMemoryBumpRatio": 0.9}), "between 1 and 4"),
    ("cooldown", with_("remediation", {"cooldownSeconds": 86401}), "cooldownSeconds"),
    ("max per hour", with_("remediation", {"maxPerHour": 61}), "maxPerHour"),
    ("milli memory", with_("resources", {"limits": {"memory": "512m"}}), "'m' means milli"),
    (
        "request > limit",
        with_("resources", {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}),
        "exceeds",
    ),
    (
        "batched < seqs",
        with_("engine", {"maxNumSeqs": 512, "maxNumBatchedTokens": 256}),
        "must be >= spec.engine",
    ),
    ("block size", with_("engine", {"blockSize": 24}), "blockSize must be one of 8, 16, 32, 64, 128"),
    ("dtype", with_("engine", {"dtype": "int4"}), "spec.engine.dtype must be one of"),
    ("kv dtype", with_("engine", {"kvCacheDtype": "int8"}), "spec.engine.kvCacheDtype must be one of"),
    ("logits mode", with_("engine", {"logitsMode": "scatter"}), "spec.engine.logitsMode"),
    ("extraArgs type", with_("engine", {"extraArgs": "--enable-prefix-caching"}), "list of strings"),
    (
        "extraArgs owned",
        with_("engine", {"extraArgs": ["--max_model_len=4096"]}),
        "use spec.engine.maxModelLen",
    ),
    ("agent port clash", with_("agent", {"port": 8000}), "vLLM's HTTP port"),
    ("agent port low", with_("agent", {"port": 80}), "between 1024 and 65535"),
    ("sample hz", with_("agent", {"sampleHz": 0}), "above 0"),
    (
        "shape and configMap",
        with_("model.configMap", {"name": "cfg"}, with_("model.shape", {"vocabSize": 1})),
        "not both",
    ),
    ("shape unknown key", with_("model.shape", {"vocab": 1}), "unknown field(s) vocab"),
    ("shape bad value", with_("model.shape", {"vocabSize": -3}), "spec.model.shape.vocabSize"),
    ("configMap no name", with_("model.configMap", {"key": "config.json"}), "configMap.name is required"),
]


@pytest.mark.parametrize(("case", "doc", "fragment"), BAD, ids=[b[0] for b in BAD])
def test_bad_specs_are_refused_with_an_actionable_message(
    case: str, doc: dict[str, Any], fragment: str
) -> None:
    # the step's two checks: the spec's syntax (parse_spec), then what its model makes of it (resolve)
    with pytest.raises(SpecError) as exc:
        resolve(parse_spec(doc))
    assert fragment in str(exc.value), str(exc.value)


def test_extra_args_conflict_message_names_the_field_to_use() -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec(with_("engine", {"extraArgs": ["--kv-cache-memory-bytes", "1000"]}))
    assert str(exc.value) == (
        "spec.engine.extraArgs[0] --kv-cache-memory-bytes is owned by rankguard; "
        "use spec.memory.kvCacheMemoryBytes instead"
    )


def test_boundaries_are_inclusive() -> None:
    s = parse_spec(
        with_(
            "memory",
            {"gpuMemoryUtilization": 0.99, "minHeadroomBytes": 512 * MiB, "safetyMarginBytes": 512 * MiB},
            with_("remediation", {"maxPerHour": 0, "cooldownSeconds": 0, "hostMemoryBumpRatio": 4}),
        )
    )
    assert s.memory.gpu_memory_utilization == 0.99
    assert s.memory.min_headroom_bytes == s.memory.safety_margin_bytes
    assert (s.remediation.max_per_hour, s.remediation.cooldown_seconds) == (0, 0)
    assert parse_spec(with_("replicas", 0)).replicas == 0
    assert parse_spec(with_("tensorParallelSize", 8)).tp == 8


# --- the model ---------------------------------------------------------------------------------


def test_shape_override_makes_an_unknown_model_plannable() -> None:
    shape = {
        "vocabSize": 32000,
        "hiddenSize": 4096,
        "numLayers": 32,
        "numHeads": 32,
        "numKVHeads": 8,
        "intermediateSize": 11008,
        "tieWordEmbeddings": False,
    }
    s = parse_spec(with_("model", {"name": "acme/private-7b", "shape": shape}))
    got = resolve(s).shape
    assert got is not None
    assert (got.name, got.vocab_size, got.num_layers, got.head_dim) == ("acme/private-7b", 32000, 32, 128)


def test_config_map_model_is_resolved_from_the_callers_config_json() -> None:
    s = parse_spec(with_("model", {"name": "acme/private-7b", "configMap": {"name": "acme-config"}}))
    assert (s.model.config_map, s.model.config_map_key) == ("acme-config", "config.json")
    unread = resolve(s)
    assert unread.shape is None and "has not been read yet" in unread.reason
    hf = {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 11008,
    }
    read = resolve(s, ConfigRead(doc=hf)).shape
    assert read is not None and read.num_kv_heads == 8
    s3 = parse_spec(
        with_(
            "tensorParallelSize", 3, with_("model", {"name": "acme/private-7b", "configMap": {"name": "c"}})
        )
    )
    with pytest.raises(SpecError, match="must divide the 32 attention heads"):
        resolve(s3, ConfigRead(doc=hf))


# --- drift against crds/llmservice.yaml -------------------------------------------------------


def test_defaults_and_enums_match_the_crd() -> None:
    p = crd_spec_schema()["properties"]
    e, m, r, a = (p[k]["properties"] for k in ("engine", "memory", "remediation", "agent"))
    assert e["maxNumSeqs"]["default"] == parse_spec(MINIMAL).engine.max_num_seqs
    assert e["maxNumBatchedTokens"]["default"] == parse_spec(MINIMAL).engine.max_num_batched_tokens
    assert "default" not in e["blockSize"] and tuple(e["blockSize"]["enum"]) == BLOCK_SIZES
    assert tuple(e["dtype"]["enum"]) == DTYPES and tuple(e["kvCacheDtype"]["enum"]) == KV_CACHE_DTYPES
    assert set(e["logitsMode"]["enum"]) == {"all-gather", "gather"}
    assert m["safetyMarginBytes"]["default"] == 512 * MiB
    assert m["minHeadroomBytes"]["default"] == DEFAULT_MIN_HEADROOM_BYTES
    assert m["reclaim"]["default"] is True
    assert r["cooldownSeconds"]["default"] == DEFAULT_COOLDOWN_SECONDS
    assert r["maxPerHour"]["default"] == DEFAULT_MAX_PER_HOUR
    assert r["hostMemoryBumpRatio"]["default"] == DEFAULT_HOST_MEMORY_BUMP_RATIO
    assert r["enabled"]["default"] is True
    assert a["port"]["default"] == DEFAULT_AGENT_PORT and a["sampleHz"]["default"] == DEFAULT_SAMPLE_HZ
    assert a["probe"]["default"] is True
    top = crd_spec_schema()["properties"]
    assert top["replicas"]["default"] == 1 and top["tensorParallelSize"]["default"] == 1
