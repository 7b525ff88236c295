"""What the operator exports per LLMService (core/status/figures, edge/metrics): the gauges
read from the status as written, memory terminations counted whatever was done about them,
one log sentence per phase change, and every series gone with the service."""

from __future__ import annotations

from typing import Any

import yaml
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rankguard_operator.core.observe.pods import terminations
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.status.figures import Figures, figures, memory_terminations, phase_change
from rankguard_operator.edge.metrics import OOMS_OBSERVED, REMEDIATIONS, SERVICE_GAUGES, forget_service
from tests import REPO

SPEC = yaml.safe_load((REPO / "examples" / "llama3-70b-tp4.yaml").read_text())["spec"]
SPEC["memory"]["minHeadroomBytes"] = 256 << 20
PARSED = parse_spec(SPEC)


def status(**more: Any) -> dict[str, Any]:
    return {
        "phase": "Running",
        "budget": {"kvCacheMemoryBytes": 40 << 30, "source": "planned"},
        "ranks": [
            {"rank": 1, "headroomBytes": 2 << 30, "stale": False},
            {"rank": 0, "headroomBytes": 3 << 29, "stale": False},
            {"rank": 2, "headroomBytes": 1 << 20, "stale": True},  # old news: not exported
        ],
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "AsExpected"},
            {"type": "Degraded", "status": "False", "reason": "AsExpected"},
        ],
        **more,
    }


def samples(name: str, **labels: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_the_gauges_are_read_from_the_status_as_written() -> None:
    f = figures(status(), PARSED)
    assert f.kv_budget_bytes == 40 << 30
    assert f.rank_headroom == ((0, 3 << 29), (1, 2 << 30)) and f.min_headroom_bytes == 3 << 29
    assert f.headroom_target_bytes == 256 << 20
    assert ("Ready", "True", "AsExpected") in f.conditions and f.phase == "Running"


def test_what_is_not_known_is_left_out() -> None:
    f = figures({"phase": "Pending", "budget": {"gpuMemoryUtilization": 0.9}}, None)
    assert (f.kv_budget_bytes, f.rank_headroom, f.min_headroom_bytes) == (None, (), None)
    assert f.headroom_target_bytes is None  # a spec that cannot be read has no target


def test_a_phase_change_is_one_sentence_with_the_reason() -> None:
    degraded = {
        "phase": "Degraded",
        "conditions": [{"type": "Degraded", "status": "True", "reason": "OOMAtFloor", "message": "at 2Gi"}],
    }
    assert phase_change({"phase": "Running"}, degraded) == "phase Running -> Degraded (OOMAtFloor: at 2Gi)"
    assert phase_change({}, {"phase": "Pending"}) == "phase none -> Pending"
    assert phase_change({"phase": "Degraded"}, degraded) is None


def test_every_memory_termination_counts_not_only_those_acted_upon() -> None:
    def ended(reason: str, message: str) -> dict[str, Any]:
        return {"terminated": {"reason": reason, "exitCode": 1, "message": message}}

    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity"
    pod = {
        "metadata": {"name": "p", "uid": "u1"},
        "status": {
            "containerStatuses": [
                {
                    "name": "vllm",
                    "restartCount": 2,
                    "lastState": ended("OOMKilled", ""),
                    "state": ended("Error", oom),
                }
            ]
        },
    }
    kinds = sorted(t.kind for t in memory_terminations(terminations(pod)))
    assert kinds == ["CUDAOutOfMemory", "OOMKilled"]


def test_a_deleted_service_leaves_no_series() -> None:
    SERVICE_GAUGES.set("ns-a", "gone", figures(status(), PARSED))
    SERVICE_GAUGES.set("ns-a", "kept", Figures(phase="Degraded"))
    OOMS_OBSERVED.labels(namespace="ns-a", llmservice="gone", reason="CUDAOutOfMemory", rank="0").inc()
    REMEDIATIONS.labels("ns-a", "gone", "ShrinkKVCache", "CUDAOutOfMemory").inc()
    phases = samples("rankguard_llmservice_phase", namespace="ns-a", llmservice="gone")
    assert sorted(v for v in phases.values()) == [0, 0, 0, 0, 0, 1]  # a state set: one phase at 1
    assert samples("rankguard_llmservice_phase", llmservice="gone", phase="Running")
    assert samples("rankguard_llmservice_rank_headroom_bytes", llmservice="gone", rank="1") == {
        (("llmservice", "gone"), ("namespace", "ns-a"), ("rank", "1")): float(2 << 30)
    }
    forget_service("ns-a", "gone")
    text = generate_latest(REGISTRY).decode()
    assert 'llmservice="gone"' not in text
    assert samples("rankguard_llmservice_phase", llmservice="kept", phase="Degraded")
    forget_service("ns-a", "kept")


def test_the_capacity_is_exported_with_vllms_model_name_label() -> None:
    capacity = {"tokens": 398_000, "maxConcurrency": 48.58, "source": "engine", "modelName": "llama"}
    f = figures(status(capacity=capacity), PARSED)
    assert (f.kv_capacity_tokens, f.kv_max_concurrency, f.model_name) == (398_000, 48.58, "llama")
    SERVICE_GAUGES.set("ns-c", "cap", f)
    SERVICE_GAUGES.set("ns-c", "unknown", figures(status(), PARSED))
    try:
        labels = (("llmservice", "cap"), ("model_name", "llama"), ("namespace", "ns-c"))
        assert samples("rankguard_llmservice_kv_capacity_tokens", namespace="ns-c") == {labels: 398_000.0}
        assert samples("rankguard_llmservice_kv_max_concurrency", namespace="ns-c") == {labels: 48.58}
    finally:
        forget_service("ns-c", "cap")
        forget_service("ns-c", "unknown")
    assert not samples("rankguard_llmservice_kv_capacity_tokens", namespace="ns-c")


def test_without_a_capacity_the_model_name_is_the_specs() -> None:
    f = figures(status(), PARSED)
    assert (f.kv_capacity_tokens, f.kv_max_concurrency) == (None, None)
    assert f.model_name == PARSED.model.name
