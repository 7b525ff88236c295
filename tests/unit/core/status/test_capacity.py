"""`status.capacity` (core/status/capacity): the KV tokens one replica holds, from the plan until
an engine of the flags in effect reports its own "KV cache size" line, then the engine's; kept
while no pod reports (0 replicas) until the flags or the budget's spec inputs change.

The engine lines are rendered from the recorded vLLM 0.34 snapshot's template and read by the
agent's own recogniser, as a pod's report carries them."""

from __future__ import annotations

from typing import Any

import pytest

from rankguard_agent.wire.recognisers import KVObservation, recognise_all
from rankguard_agent.wire.report import KVLine, RankSample, Report
from rankguard_operator import vllm_snapshots
from rankguard_operator.core.budget.bounds import (
    VLLM_DEFAULT_UTILIZATION,
    budget_key,
    initial_plan,
    utilization_kv_bytes,
)
from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.headroom import Observation, aggregate
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec
from rankguard_operator.core.status.build import budget_status, build_status
from rankguard_operator.core.status.capacity import capacity_status
from rankguard_operator.core.units import GiB

NOW = 1_800_000_000.0
KV_SIZE = vllm_snapshots.load("0.34.0").messages("kv_cache_size")[0]


def spec(image: str = "vllm/vllm-openai:v0.33.0", **engine: Any) -> ServiceSpec:
    return parse_spec(
        {
            "model": {"name": "meta-llama/Meta-Llama-3-70B"},
            "image": image,
            "tensorParallelSize": 4,
            "engine": {"maxModelLen": 8192, **engine},
            "memory": {"gpuMemoryBytes": 80 * GiB},
        }
    )


def must(plan: Plan | None) -> Plan:
    assert plan is not None
    return plan


SPEC = spec()
PLAN = must(initial_plan(SPEC))
KEY = budget_key(SPEC)
FLAGS = ServingFlags(kv_cache_memory_bytes=PLAN.kv_cache_memory_bytes)


def engine_report(tokens: int, concurrency: float) -> Report:
    """A pod's report with the engine's one line of KV size and concurrency, as vLLM 0.34 prints
    it (kv_cache_utils.py update_kv_cache_capacity) and the agent reads it."""
    text = str(KV_SIZE["template"]) % ("GPU", f"{tokens:,}", f"{8192:,}", concurrency)
    seen = [o for o in recognise_all(f"(EngineCore_DP0 pid=9) INFO [kv_cache_utils.py:1169] {text}")]
    lines = [KVLine(o.kind, o.text, o.value, NOW) for o in seen if isinstance(o, KVObservation)]
    assert len(lines) == 2, text
    sample = RankSample(0, "GPU-0", 80 * GiB, 70 * GiB, 10 * GiB, 9 * GiB, 60.0)
    return Report(version=1, agent_version="0.1.0", timestamp=NOW, ranks=[sample], kv_lines=lines)


def observed(*reports: Report) -> Observation:
    return aggregate([(f"pod-{i}", r, NOW) for i, r in enumerate(reports)], NOW, 90.0)


def planned(plan: Plan, kv: int, name: str = "meta-llama/Meta-Llama-3-70B") -> dict[str, Any]:
    cap = plan.capacity(kv)
    return {
        "tokens": cap.tokens,
        "maxConcurrency": round(cap.max_concurrency, 2),
        "source": "planned",
        "modelName": name,
    }


def test_before_any_engine_reports_the_plan_says_what_the_budget_holds() -> None:
    got = capacity_status(PLAN, FLAGS, SPEC, None, old={}, budget_key=KEY)
    assert got == planned(PLAN, FLAGS.kv_cache_memory_bytes or 0)
    # the same figure status.budget shows
    budget = budget_status(PLAN, FLAGS, SPEC)
    assert got is not None
    assert (got["tokens"], got["maxConcurrency"]) == (budget["tokens"], budget["maxConcurrency"])


@pytest.mark.parametrize("util", [0.85, None])
def test_a_utilisation_holds_what_the_plan_estimates_it_leaves(util: float | None) -> None:
    flags = ServingFlags(gpu_memory_utilization=util)
    kv = utilization_kv_bytes(PLAN, VLLM_DEFAULT_UTILIZATION if util is None else util)
    assert capacity_status(PLAN, flags, SPEC, None, old={}, budget_key=KEY) == planned(PLAN, kv)


def test_engine_measured_flags_are_planned_at_the_rendered_utilisation() -> None:
    # vLLM 0.34 sizes its KV cache after warm-up: status.budget has no tokens, status.capacity has
    s = spec("vllm/vllm-openai:v0.34.0")
    plan = must(initial_plan(s))
    flags = ServingFlags(engine_measured=True, gpu_memory_utilization=0.93)
    assert "tokens" not in budget_status(plan, flags, s)
    got = capacity_status(plan, flags, s, None, old={}, budget_key=budget_key(s))
    assert got == planned(plan, utilization_kv_bytes(plan, 0.93))


def test_once_engines_report_their_lowest_figures_are_the_capacity() -> None:
    obs = observed(engine_report(401_234, 48.98), engine_report(398_000, 48.58))
    got = capacity_status(PLAN, FLAGS, SPEC, obs, old={}, budget_key=KEY)
    name = SPEC.model.name
    assert got == {"tokens": 398_000, "maxConcurrency": 48.58, "source": "engine", "modelName": name}


def test_a_stale_report_is_no_engine_figure() -> None:
    stale = aggregate([("pod-0", engine_report(401_234, 48.98), NOW - 600)], NOW, 90.0)
    got = capacity_status(PLAN, FLAGS, SPEC, stale, old={}, budget_key=KEY)
    assert got is not None and got["source"] == "planned"


def status_after(
    old: dict[str, Any], obs: Observation | None, flags: ServingFlags, s: ServiceSpec = SPEC
) -> dict[str, Any]:
    """One pass's status as core/step/report writes it (build_status, then the fields it adds)."""
    new = build_status(
        old=old,
        spec=s,
        generation=1,
        now_iso="2027-01-15T08:00:00Z",
        observation=obs,
        flags=flags,
        last_known_good=None,
        plan=PLAN,
        prior=PLAN,
        decision=None,
        rollout=None,
        ready_replicas=0,
        history=[],
        budget_key=budget_key(s),
    )
    return {**new, "servingFlags": flags.to_status(), "budgetKey": budget_key(s)}


def test_the_engine_figure_outlives_its_pods_until_the_flags_change() -> None:
    reported = status_after({}, observed(engine_report(398_000, 48.58)), FLAGS)
    assert reported["capacity"]["source"] == "engine"
    # scaled to 0 replicas: no pod reports, the engine's figure stays
    idle = status_after(reported, None, FLAGS)
    assert idle["capacity"] == reported["capacity"]
    assert status_after(idle, observed(), FLAGS)["capacity"] == reported["capacity"]
    # a new budget: its engine has not spoken, the plan speaks for it until it does
    smaller = ServingFlags(kv_cache_memory_bytes=(FLAGS.kv_cache_memory_bytes or 0) // 2)
    moved = status_after(idle, None, smaller)
    assert moved["capacity"] == planned(PLAN, smaller.kv_cache_memory_bytes or 0)
    # and does not come back when the old flags do: nothing says the old engine's figure holds
    assert status_after(moved, None, FLAGS)["capacity"]["source"] == "planned"


def test_a_change_of_the_budgets_spec_inputs_drops_the_engine_figure() -> None:
    reported = status_after({}, observed(engine_report(398_000, 48.58)), FLAGS)
    other = spec(maxNumSeqs=64)
    assert budget_key(other) != KEY
    assert status_after(reported, None, FLAGS, other)["capacity"]["source"] == "planned"


def test_the_model_name_is_vllms_label_the_first_served_model_name() -> None:
    s = spec(extraArgs=["--served-model-name", "llama", "llama-70b"])
    got = capacity_status(PLAN, FLAGS, s, None, old={}, budget_key=budget_key(s))
    assert got is not None and got["modelName"] == "llama"
    s = spec(extraArgs=["--served-model-name=first", "--served-model-name", "last"])
    got = capacity_status(PLAN, FLAGS, s, None, old={}, budget_key=budget_key(s))
    assert got is not None and got["modelName"] == "last"  # argparse keeps the last flag


def test_nothing_known_is_none() -> None:
    assert capacity_status(PLAN, None, SPEC, None, old={}, budget_key=KEY) is None
    assert capacity_status(None, FLAGS, SPEC, None, old={}, budget_key=KEY) is None
