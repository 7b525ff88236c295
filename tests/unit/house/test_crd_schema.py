"""Across modules: static checks of crds/llmservice.yaml: shape of the API, documentation, and
agreement with the planner. (tests/cluster/test_crd.py checks the same file on a real API server.)"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.budget.memory_model import kv_dtype_bytes
from rankguard_operator.core.budget.planner import PlanInput
from rankguard_operator.core.model.resolve import REQUIRED_OVERRIDE_KEYS
from rankguard_operator.core.spec.crd import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SAFETY_MARGIN_BYTES,
    LOGITS_MODES,
    SHAPE_OVERRIDE_KEYS,
)
from rankguard_operator.core.spec.parse import parse_spec
from tests import REPO

CRD = yaml.safe_load((REPO / "crds" / "llmservice.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
ROOT = VERSION["schema"]["openAPIV3Schema"]
SPEC = ROOT["properties"]["spec"]
STATUS = ROOT["properties"]["status"]
EXAMPLE = yaml.safe_load((REPO / "examples" / "llama3-70b-tp4.yaml").read_text())


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node below `node` with its dotted path (array items as `path[]`)."""
    for name, child in node.get("properties", {}).items():
        p = f"{path}.{name}" if path else name
        yield p, child
        yield from walk(child, p)
    items = node.get("items")
    if isinstance(items, dict):
        yield f"{path}[]", items
        yield from walk(items, f"{path}[]")


def node_at(path: str) -> dict[str, Any]:
    node: dict[str, Any] = ROOT
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_names_group_version_and_subresources() -> None:
    assert CRD["metadata"]["name"] == "llmservices.rankguard.io"
    spec = CRD["spec"]
    assert spec["group"] == "rankguard.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "LLMService"
    assert spec["names"]["plural"] == "llmservices"
    assert spec["names"]["shortNames"] == ["llmsvc"]
    assert [v["name"] for v in spec["versions"]] == ["v1alpha1"]
    assert VERSION["served"] and VERSION["storage"]
    assert set(VERSION["subresources"]) == {"status", "scale"}  # scale: tests/unit/core/status/test_scale.py


def test_printer_columns_in_the_documented_order() -> None:
    cols = VERSION["additionalPrinterColumns"]
    default = [c for c in cols if c.get("priority", 0) == 0]
    # kubectl prints NAME first, then the columns upper-cased in this order
    assert ["NAME", *(c["name"].upper() for c in default)] == [
        "NAME",
        "MODEL",
        "TP",
        "PP",
        "PODS",
        "READY",
        "KV-BUDGET",
        "RANK0",
        "MIN-HEADROOM",
        "BOTTLENECK",
        "PHASE",
        "AGE",
    ]
    age = default[-1]
    assert (age["type"], age["jsonPath"]) == ("date", ".metadata.creationTimestamp")
    # wide columns come only after the default ones
    priorities = [c.get("priority", 0) for c in cols]
    assert priorities == sorted(priorities)


@pytest.mark.parametrize("column", VERSION["additionalPrinterColumns"], ids=lambda c: c["name"])
def test_printer_columns_point_at_documented_fields(column: dict[str, Any]) -> None:
    assert column.get("description")
    if column["jsonPath"] == ".metadata.creationTimestamp":
        return
    node = node_at(column["jsonPath"])
    assert node.get("description")
    expected_type = {"integer": "integer", "number": "number", "string": "string"}[column["type"]]
    assert node.get("type") == expected_type


# Kubernetes' own PodSpec, converted by hack/pod-template-schema: its descriptions are kept two
# levels deep (the PodSpec fields and theirs), where `kubectl explain` users look.
GENERATED = "spec.template.spec."


def test_every_field_has_a_description() -> None:
    missing = [
        p
        for p, node in walk(ROOT)
        if p != "metadata"
        and not node.get("description", "").strip()
        and not (p.startswith(GENERATED) and p.count(".") > GENERATED.count(".") + 1)
        and not (p.startswith(GENERATED) and p.endswith("[]"))
    ]
    assert missing == []


def test_no_field_escapes_the_schema() -> None:
    text = (REPO / "crds" / "llmservice.yaml").read_text()
    assert "x-kubernetes-preserve-unknown-fields" not in text
    for path, node in walk(ROOT):
        if path == "metadata":
            continue
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), f"{path} has no type"


def test_byte_fields_are_int64_integers() -> None:
    byte_fields = [(p, n) for p, n in walk(ROOT) if p.endswith("Bytes")]
    assert len(byte_fields) >= 10
    for path, node in byte_fields:
        assert node["type"] == "integer", path
        assert node.get("format") == "int64", path


def test_spec_fields_from_the_design() -> None:
    props = SPEC["properties"]
    assert set(props) >= {
        "model",
        "image",
        "replicas",
        "tensorParallelSize",
        "pipelineParallelSize",
        "engine",
        "memory",
        "remediation",
        "resources",
        "agent",
    }
    assert set(props["engine"]["properties"]) >= {
        "maxNumSeqs",
        "maxModelLen",
        "maxNumBatchedTokens",
        "dtype",
        "kvCacheDtype",
        "blockSize",
        "enforceEager",
        "extraArgs",
        "logitsMode",
    }
    assert set(props["memory"]["properties"]) >= {
        "gpuMemoryUtilization",
        "kvCacheMemoryBytes",
        "safetyMarginBytes",
        "minHeadroomBytes",
        "reclaim",
        "gpuMemoryBytes",
    }
    assert set(props["remediation"]["properties"]) >= {
        "enabled",
        "cooldownSeconds",
        "maxPerHour",
        "minKVCacheBytes",
        "maxKVCacheBytes",
        "hostMemoryBumpRatio",
        "maxHostMemory",
    }
    assert set(props["agent"]["properties"]) >= {"image", "port", "probe", "sampleHz"}
    assert SPEC["required"] == ["model", "image"]
    tp = props["tensorParallelSize"]
    assert (tp["minimum"], tp["maximum"]) == (1, 64)
    assert props["replicas"]["minimum"] == 0
    util = props["memory"]["properties"]["gpuMemoryUtilization"]
    assert [r["rule"] for r in util["x-kubernetes-validations"]] == ["self > 0.0 && self <= 0.99"]
    assert "default" not in util  # a default would collide with a pinned kvCacheMemoryBytes
    assert props["remediation"]["properties"]["cooldownSeconds"]["minimum"] == 0


def test_status_fields_from_the_design() -> None:
    props = STATUS["properties"]
    assert set(props) >= {
        "phase",
        "observedGeneration",
        "conditions",
        "ranks",
        "bottleneckRank",
        "readyReplicas",
        "ready",
        "kvBudget",
        "rank0Headroom",
        "minHeadroom",
        "bottleneck",
        "budget",
        "lastKnownGood",
        "remediations",
        "pendingRemediation",
    }
    assert set(props["conditions"]["items"]["properties"]) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    assert props["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert set(props["ranks"]["items"]["properties"]) >= {
        "rank",
        "uuid",
        "totalBytes",
        "freeBytes",
        "minFreeBytes",
        "headroomBytes",
        "headroom",
        "stale",
    }
    assert set(props["budget"]["properties"]) >= {
        "kvCacheMemoryBytes",
        "gpuMemoryUtilization",
        "blocks",
        "tokens",
        "maxConcurrency",
        "source",
    }
    assert set(props["lastKnownGood"]["properties"]) >= {
        "flags",
        "kvCacheMemoryBytes",
        "memoryLimit",
        "revision",
    }
    assert props["remediations"]["maxItems"] == 20
    assert set(props["remediations"]["items"]["properties"]) >= {
        "time",
        "trigger",
        "rank",
        "from",
        "to",
        "revision",
        "message",
    }
    assert set(props["pendingRemediation"]["properties"]) >= {"id", "kind", "targetRevision", "startedAt"}


def test_arrays_are_bounded() -> None:
    # CEL cost estimation and etcd object size both need bounds
    for path, node in walk(ROOT):
        if path in ("apiVersion", "kind"):  # standard, validated by the API server itself
            continue
        if path.startswith(GENERATED):
            # Kubernetes' PodSpec bounds only what it bounds; the lists and names the CEL rules
            # walk get bounds from the generator (MAX_ITEMS, MAX_LENGTH), checked on a real API
            # server, which refuses a CRD whose rules could cost too much.
            continue
        if node.get("type") == "array":
            assert "maxItems" in node, path
        if node.get("type") == "string" and "enum" not in node and node.get("format") != "date-time":
            assert "maxLength" in node, path


def rules() -> list[tuple[str, dict[str, Any]]]:
    return [(p, r) for p, n in walk(ROOT) for r in n.get("x-kubernetes-validations", [])]


def test_every_cel_rule_has_its_own_actionable_message() -> None:
    all_rules = rules()
    assert len(all_rules) >= 14
    messages = [r["message"] for _, r in all_rules]
    assert all(len(m) >= 30 for m in messages), messages
    assert len(set(messages)) == len(messages)


def test_transition_rule_guards_tp_changes_with_a_pinned_budget() -> None:
    transition = [r for _, r in rules() if "oldSelf" in r["rule"]]
    assert len(transition) == 1
    rule = transition[0]
    assert "tensorParallelSize" in rule["rule"] and "kvCacheMemoryBytes" in rule["rule"]
    assert "Remove memory.kvCacheMemoryBytes" in rule["message"]


def test_shape_override_matches_the_model_resolver() -> None:
    shape = SPEC["properties"]["model"]["properties"]["shape"]
    assert set(shape["properties"]) == set(SHAPE_OVERRIDE_KEYS)
    assert tuple(shape["required"]) == REQUIRED_OVERRIDE_KEYS
    for key, node in shape["properties"].items():
        if node["type"] == "integer":
            assert node["minimum"] == 1, key


def test_defaults_agree_with_the_planner() -> None:
    engine = SPEC["properties"]["engine"]["properties"]
    assert engine["maxNumSeqs"]["default"] == DEFAULT_MAX_NUM_SEQS
    assert engine["maxNumBatchedTokens"]["default"] == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert "default" not in engine["blockSize"]  # unset: vLLM picks it per attention backend
    assert set(engine["logitsMode"]["enum"]) == set(LOGITS_MODES)
    assert engine["logitsMode"]["default"] == PlanInput.__dataclass_fields__["logits_mode"].default
    memory = SPEC["properties"]["memory"]["properties"]
    assert memory["safetyMarginBytes"]["default"] == DEFAULT_SAFETY_MARGIN_BYTES
    assert memory["minHeadroomBytes"]["default"] <= memory["safetyMarginBytes"]["default"]
    for dtype in engine["kvCacheDtype"]["enum"]:
        assert kv_dtype_bytes(dtype) in (1, 2)
    for dtype in engine["dtype"]["enum"]:
        assert kv_dtype_bytes("auto", dtype) in (2, 4)


def test_defaults_are_valid_values() -> None:
    for path, node in walk(ROOT):
        if "default" not in node:
            continue
        d = node["default"]
        if "enum" in node:
            assert d in node["enum"], path
        if "minimum" in node:
            assert d > node["minimum"] if node.get("exclusiveMinimum") else d >= node["minimum"], path
        if "maximum" in node:
            assert d <= node["maximum"], path


def rule_regex(says: str) -> re.Pattern[str]:
    """The regex of the CEL rule whose message says `says` (RE2 and Python agree on these)."""
    return re.compile(
        next(
            m.group(1)
            for _, r in rules()
            if says in r["message"] and (m := re.search(r"matches\('([^']+)'\)", r["rule"])) is not None
        )
    )


MANAGED_REGEX = rule_regex("must not set options rankguard manages")


@pytest.mark.parametrize(
    "arg",
    [
        "--kv-cache-memory-bytes=1000",
        "--kv-cache-memory-bytes",
        "--kv_cache_memory_bytes=5",
        "--gpu-memory-utilization",
        "--gpu-memory-utilization=0.8",
        "--tensor-parallel-size",
        "-tp",
        "-tp=4",
        "--pipeline-parallel-size=2",
        "-pp",
        "--max-num-seqs=64",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--block-size=32",
        "--kv-cache-dtype=fp8",
        "--dtype",
        "--enforce-eager",
    ],
)
def test_extra_args_rule_refuses_managed_flags(arg: str) -> None:
    assert MANAGED_REGEX.match(arg)


@pytest.mark.parametrize(
    "arg",
    [
        "--enable-prefix-caching",
        "--max-num-seqs-per-user",
        "--swap-space=4",
        "16",
        "--served-model-name=x",
        "--tokenizer-mode",
        "auto",
        "--gpu-memory",
    ],
)
def test_extra_args_rule_allows_other_flags(arg: str) -> None:
    assert not MANAGED_REGEX.match(arg)


def check_against_schema(doc: Any, node: dict[str, Any], path: str) -> None:
    """A small structural validator: every key known, types, enums and ranges respected."""
    if node.get("x-kubernetes-int-or-string"):
        assert isinstance(doc, (int, str)), path
        return
    t = node.get("type")
    if t == "object":
        assert isinstance(doc, dict), path
        for req in node.get("required", []):
            assert req in doc, f"{path}.{req} is required"
        for key, value in doc.items():
            assert key in node.get("properties", {}), f"{path}.{key} is not in the schema"
            check_against_schema(value, node["properties"][key], f"{path}.{key}")
    elif t == "array":
        assert isinstance(doc, list), path
        for i, value in enumerate(doc):
            check_against_schema(value, node["items"], f"{path}[{i}]")
    elif t == "integer":
        assert isinstance(doc, int) and not isinstance(doc, bool), path
    elif t == "number":
        assert isinstance(doc, (int, float)) and not isinstance(doc, bool), path
    elif t == "string":
        assert isinstance(doc, str), path
    elif t == "boolean":
        assert isinstance(doc, bool), path
    if "enum" in node:
        assert doc in node["enum"], path
    if "minimum" in node:
        assert doc >= node["minimum"], path
    if "maximum" in node:
        assert doc <= node["maximum"], path


def test_example_fits_the_schema_and_plans() -> None:
    assert EXAMPLE["apiVersion"] == "rankguard.io/v1alpha1"
    assert EXAMPLE["kind"] == "LLMService"
    spec = EXAMPLE["spec"]
    check_against_schema(spec, SPEC, "spec")
    assert spec["tensorParallelSize"] == 4
    assert "vllm/vllm-openai" in spec["image"]
    # planned as the operator plans it (an A100 80 GB's size, when the example leaves it to the agents)
    plan = prior_plan(parse_spec(spec), learned_gpu_bytes=84_974_239_416)
    assert plan is not None
    assert plan.feasible
    assert plan.kv_cache_memory_bytes >= spec["remediation"]["minKVCacheBytes"]


def test_schema_validator_catches_mistakes() -> None:
    # the helper above must be able to fail, or the example test proves nothing
    bad = {**EXAMPLE["spec"], "tensorParalelSize": 4}
    with pytest.raises(AssertionError, match="tensorParalelSize"):
        check_against_schema(bad, SPEC, "spec")
    with pytest.raises(AssertionError, match="tensorParallelSize"):
        check_against_schema({**EXAMPLE["spec"], "tensorParallelSize": 65}, SPEC, "spec")


def test_the_crd_still_fits_a_client_side_kubectl_apply() -> None:
    # `kubectl apply` without --server-side stores the whole object as JSON in an annotation,
    # and annotations are capped at 256 KiB; the embedded PodSpec is the bulk of it.
    text = json.dumps(yaml.safe_load((REPO / "crds" / "llmservice.yaml").read_text()), separators=(",", ":"))
    assert len(text) < 200 * 1024
