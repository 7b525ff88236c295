"""`reconcile.step`: every path of one operator pass, without a cluster.

A small in-memory cluster (`Cluster`) carries out the effects the way the edge executor does
(status merge patches, Deployment applies with generations, named Events), so the tests read
like the loop: apply an LLMService, let a pod run, let it die, and count what was rolled.
The property at the end drives crashes of the operator between any two effects.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankguard_agent import termination as tm
from rankguard_agent.report import RankSample, Report
from rankguard_operator.core import reconcile
from rankguard_operator.core.budget import prior_plan
from rankguard_operator.core.flags import ServingFlags
from rankguard_operator.core.names import (
    FLAGS_ANNOTATION,
    REMEDIATION_ID_ANNOTATION,
    TEMPLATE_HASH_ANNOTATION,
    label_value,
)
from rankguard_operator.core.observe import deployment_template_hash
from rankguard_operator.core.spec import parse_spec
from rankguard_operator.core.units import GiB

SETTINGS = reconcile.Settings(agent_image="agent:test", stale_after=30.0)
T0 = 1_800_000_000.0
SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 2,
    "engine": {"maxModelLen": 8192},
    "memory": {"gpuMemoryBytes": 80 * GiB},
    "agent": {"port": 9404},
}


def cuda_oom_record(rank: int = 0) -> dict[str, Any]:
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=rank,
        gpu_index=rank,
        requested_bytes=2 * GiB,
        free_bytes=GiB,
        total_bytes=80 * GiB,
        detail="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    ).to_json()
    return {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies a status merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


@dataclass
class Cluster:
    """What the API server holds for one LLMService, changed only through effects."""

    spec: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SPEC))
    generation: int = 1
    status: dict[str, Any] = field(default_factory=dict)
    deployment: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    events: dict[str, reconcile.PostEvent] = field(default_factory=dict)
    applies: list[Mapping[str, Any]] = field(default_factory=list)
    clock: float = T0
    ids: int = 0

    def world(self, reports: tuple[reconcile.ReportInput, ...] = ()) -> reconcile.World:
        self.ids += 1
        return reconcile.World(
            name="svc",
            namespace="ns",
            uid="uid-1",
            generation=self.generation,
            spec=copy.deepcopy(self.spec),
            now=self.clock,
            new_id=f"rid-{self.ids}",
            deployment=copy.deepcopy(self.deployment),
            pods=copy.deepcopy(self.pods),
            reports=reports,
        )

    def state(self) -> reconcile.ServiceState:
        return reconcile.ServiceState.from_status(copy.deepcopy(self.status))

    def execute(self, effect: reconcile.Effect) -> None:
        if isinstance(effect, reconcile.WriteIntent):
            self.status["pendingRemediation"] = dict(effect.pending)
        elif isinstance(effect, reconcile.WriteStatus):
            self.status = merge_patch(self.status, effect.patch)
        elif isinstance(effect, reconcile.ApplyDeployment):
            self.applies.append(effect.body)
            self.deployment = reconcile.after_apply(self.deployment, copy.deepcopy(dict(effect.body)))
        elif isinstance(effect, reconcile.ApplyService):
            self.service = dict(effect.body)
        elif isinstance(effect, reconcile.PostEvent):
            key = effect.name or f"{effect.reason}#{len(self.events)}"
            self.events.setdefault(key, effect)

    def run(self, crash_after: int | None = None, **kw: Any) -> reconcile.Step:
        """One pass; with `crash_after`, the operator dies after that many effects."""
        step = reconcile.step(self.state(), self.world(**kw), SETTINGS)
        for i, effect in enumerate(step.effects):
            if crash_after is not None and i >= crash_after:
                break
            self.execute(effect)
        self.clock += 2.0
        return step

    def controller_done(self) -> None:
        """The Deployment controller rolled every replica out and the pods are ready."""
        assert self.deployment is not None
        d = self.deployment
        n = d["spec"]["replicas"]
        d["status"] = {
            "observedGeneration": d["metadata"]["generation"],
            "replicas": n,
            "updatedReplicas": n,
            "readyReplicas": n,
            "availableReplicas": n,
        }
        template = d["spec"]["template"]
        self.pods = [
            pod(f"svc-{d['metadata']['generation']}", template["metadata"]["annotations"], ready=True)
        ]

    def template_changed(self) -> bool:
        """The Deployment holds another template than the pods were created from."""
        live = deployment_template_hash(self.deployment)
        return any(p["metadata"]["annotations"].get(TEMPLATE_HASH_ANNOTATION) != live for p in self.pods)

    def kv_rolls(self) -> list[int]:
        """The distinct KV budgets the Deployment was rolled to, in order."""
        out: list[int] = []
        for body in self.applies:
            kv = flags_of(body).kv_cache_memory_bytes
            assert kv is not None
            if not out or out[-1] != kv:
                out.append(kv)
        return out


def pod(name: str, annotations: Mapping[str, str], *, ready: bool, terminated: Any = None) -> dict[str, Any]:
    status: dict[str, Any] = {
        "podIP": "127.0.0.9",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [
            {"name": "vllm", "restartCount": 1 if terminated else 0, "state": {"running": {}}}
        ],
    }
    if terminated is not None:
        status["containerStatuses"][0]["lastState"] = {"terminated": terminated}
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "annotations": dict(annotations)},
        "status": status,
    }


def flags_of(deployment: Mapping[str, Any]) -> ServingFlags:
    raw = deployment["spec"]["template"]["metadata"]["annotations"][FLAGS_ANNOTATION]
    import json

    flags = ServingFlags.from_status(json.loads(raw))
    assert flags is not None
    return flags


def report(min_free: tuple[int, ...], at: float) -> Report:
    ranks = [
        RankSample(
            rank=r,
            uuid=f"GPU-{r}",
            total_bytes=80 * GiB,
            used_bytes=80 * GiB - (m + GiB),
            free_bytes=m + GiB,
            min_free_bytes=m,
            window_seconds=10.0,
        )
        for r, m in enumerate(min_free)
    ]
    return Report(version=1, agent_version="0.1.0", timestamp=at, ranks=ranks)


def running() -> Cluster:
    """An LLMService applied and Ready: first pass, rollout done, a steady pass."""
    c = Cluster()
    c.run()
    c.controller_done()
    c.run()
    return c


def crash_the_pod(c: Cluster) -> str:
    """The serving pod's vLLM dies of a CUDA OOM on rank 0; returns the termination key."""
    p = c.pods[0]
    c.pods = [
        pod(p["metadata"]["name"], p["metadata"]["annotations"], ready=False, terminated=cuda_oom_record())
    ]
    return f"{c.pods[0]['metadata']['uid']}/vllm/0"


# --------------------------------------------------------------------------------------------
# First pass, steady state, invalid spec


def test_the_first_pass_renders_the_planned_budget_and_writes_status() -> None:
    c = Cluster()
    step = c.run()
    kinds = [type(e).__name__ for e in step.effects]
    assert kinds == ["PostEvent", "ApplyDeployment", "ApplyService", "WriteStatus"]
    plan = prior_plan(parse_spec(SPEC))
    assert plan is not None
    assert (
        c.deployment is not None
        and flags_of(c.deployment).kv_cache_memory_bytes == plan.kv_cache_memory_bytes
    )
    assert c.status["servingFlags"] == {"kvCacheMemoryBytes": plan.kv_cache_memory_bytes}
    assert c.status["phase"] == "Deploying"  # applied, not yet observed by the controller
    assert [e.reason for e in c.events.values()] == ["BudgetPlanned"]
    assert step.state.serving_flags == flags_of(c.deployment)


def test_a_steady_pass_changes_nothing_and_writes_nothing() -> None:
    c = running()
    assert c.status["phase"] == "Running"
    # The status write of a pass carries its clock-derived fields; two passes in the same
    # second over the same world write nothing and apply nothing.
    c.clock -= 2.0
    again = reconcile.step(c.state(), c.world(), SETTINGS)
    assert [e for e in again.effects if not isinstance(e, reconcile.PostEvent)] == []


def test_an_invalid_spec_gets_a_condition_and_an_event_and_nothing_is_applied() -> None:
    c = Cluster()
    c.spec["tensorParallelSize"] = 3  # 32 attention heads do not split 3 ways
    step = c.run()
    assert [type(e).__name__ for e in step.effects] == ["PostEvent", "WriteStatus"]
    assert c.deployment is None and c.service is None
    assert c.status["phase"] == "Failed"
    degraded = next(x for x in c.status["conditions"] if x["type"] == "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "tensorParallelSize" in degraded["message"]


def test_a_spec_edit_reapplies_the_service_and_rolls_the_template() -> None:
    c = running()
    applies = len(c.applies)
    c.spec["image"] = "vllm/vllm-openai:v0.12.0"
    c.generation += 1
    step = c.run()
    kinds = [type(e).__name__ for e in step.effects]
    assert "ApplyDeployment" in kinds and "ApplyService" in kinds
    assert len(c.applies) == applies + 1
    assert c.deployment is not None
    assert c.deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "vllm/vllm-openai:v0.12.0"


def test_replicas_changed_by_hand_are_put_back() -> None:
    c = running()
    assert c.deployment is not None
    c.deployment["spec"]["replicas"] = 5
    step = c.run()
    assert any(isinstance(e, reconcile.ApplyDeployment) for e in step.effects)
    assert c.deployment["spec"]["replicas"] == 1


def test_only_reports_of_pods_on_the_template_in_effect_are_read() -> None:
    c = running()
    live = c.pods[0]
    old = pod("svc-old", {TEMPLATE_HASH_ANNOTATION: "0000", FLAGS_ANNOTATION: "{}"}, ready=True)
    c.pods = [live, old]
    low = report((GiB // 8, GiB // 8), c.clock)  # far below the minimum headroom
    ok = report((6 * GiB, 6 * GiB), c.clock)
    c.run(
        reports=((str(old["metadata"]["name"]), low, c.clock), (str(live["metadata"]["name"]), ok, c.clock))
    )
    assert [r["minFreeBytes"] for r in c.status["ranks"]] == [6 * GiB, 6 * GiB]
    assert c.status["ranks"][0]["pod"] == live["metadata"]["name"]


def test_scrape_targets_are_the_ready_pods_of_the_live_template() -> None:
    c = running()
    live = c.pods[0]
    stale = pod("svc-old", {TEMPLATE_HASH_ANNOTATION: "0000"}, ready=True)
    not_ready = pod("svc-nr", live["metadata"]["annotations"], ready=False)
    targets = reconcile.scrape_targets(c.spec, c.deployment, [live, stale, not_ready])
    assert targets == [(live["metadata"]["name"], "127.0.0.9", 9404)]
    assert reconcile.scrape_targets({"model": {}}, c.deployment, [live]) == []  # unreadable spec


# --------------------------------------------------------------------------------------------
# A remediation: intent, roll, Event, status, in that order


def test_a_cuda_oom_writes_the_intent_then_rolls_once_then_reports() -> None:
    c = running()
    before = c.deployment
    assert before is not None
    old_kv = flags_of(before).kv_cache_memory_bytes
    key = crash_the_pod(c)
    step = c.run()
    kinds = [type(e).__name__ for e in step.effects]
    assert kinds == ["WriteIntent", "ApplyDeployment", "PostEvent", "WriteStatus"]
    intent, roll, event = step.effects[0], step.effects[1], step.effects[2]
    assert isinstance(intent, reconcile.WriteIntent) and isinstance(roll, reconcile.ApplyDeployment)
    assert isinstance(event, reconcile.PostEvent)
    rid = intent.pending["id"]
    assert roll.body["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == rid == roll.remediation_id
    assert event.name == rid and event.reason == "ShrankKVCache" and event.type == "Warning"
    new_kv = flags_of(roll.body).kv_cache_memory_bytes
    assert old_kv is not None and new_kv is not None and new_kv < old_kv
    assert "pendingRemediation" not in c.status
    assert key in c.status["handledTerminations"]
    [entry] = c.status["remediations"]
    assert entry["revision"] == rid and entry["trigger"] == "CUDAOutOfMemory"
    assert c.status["phase"] == "Remediating"
    # The same termination seen again (the old pod lingers while it terminates): nothing more.
    again = c.run()
    assert not any(isinstance(e, (reconcile.ApplyDeployment, reconcile.WriteIntent)) for e in again.effects)


def test_a_pending_remediation_not_yet_rolled_is_rolled_with_its_own_id() -> None:
    c = running()
    crash_the_pod(c)
    c.run(crash_after=1)  # the intent is written, then the operator dies
    pending = c.status["pendingRemediation"]
    step = c.run()  # a restarted operator
    rolls = [e for e in step.effects if isinstance(e, reconcile.ApplyDeployment)]
    assert len(rolls) == 1
    assert rolls[0].body["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == pending["id"]
    assert [h["revision"] for h in c.status["remediations"]] == [pending["id"]]
    assert [e.reason for e in step.effects if isinstance(e, reconcile.PostEvent)] == ["RemediationResumed"]
    assert "pendingRemediation" not in c.status


def test_a_pending_remediation_already_rolled_is_only_recorded() -> None:
    c = running()
    crash_the_pod(c)
    c.run(crash_after=2)  # intent and roll done; the operator died before the Event and status
    assert c.deployment is not None
    rid = c.deployment["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION]
    step = c.run()
    assert not any(isinstance(e, reconcile.ApplyDeployment) for e in step.effects)
    assert [h["revision"] for h in c.status["remediations"]] == [rid]
    events = [e for e in step.effects if isinstance(e, reconcile.PostEvent)]
    assert [(e.reason, e.name) for e in events] == [("RemediationResumed", rid)]


def test_a_hold_is_reported_as_a_repeating_event_without_a_roll() -> None:
    c = running()
    c.spec["remediation"] = {"enabled": False}
    c.generation += 1
    crash_the_pod(c)
    step = c.run()
    assert not any(isinstance(e, (reconcile.WriteIntent, reconcile.ApplyDeployment)) for e in step.effects)
    [event] = [e for e in step.effects if isinstance(e, reconcile.PostEvent)]
    assert event.reason == "RemediationDisabled" and event.repeat and event.name is None
    assert c.status["phase"] == "Degraded"


# --------------------------------------------------------------------------------------------
# Restart safety as a property: crash anywhere, any number of times, one roll per termination


@settings(max_examples=80, deadline=None)
@given(
    crashes=st.lists(st.tuples(st.integers(min_value=0, max_value=4), st.booleans()), min_size=0, max_size=4)
)
def test_any_crash_interleaving_rolls_exactly_once_per_termination(crashes: list[tuple[int, bool]]) -> None:
    c = running()
    start_rolls = c.kv_rolls()
    key = crash_the_pod(c)
    for crash_after, controller_moves in crashes:
        c.run(crash_after=crash_after)  # the operator dies after `crash_after` effects ...
        if controller_moves and c.template_changed():
            # ... and while it is down the Deployment controller replaces the crashed pod with
            # one of the template it holds now: the termination is gone when the operator
            # comes back, so only what was written down can tell it what it did. (A pod whose
            # template did not change is not replaced: its container restarts in place.)
            c.controller_done()
    for _ in range(3):  # then it runs undisturbed
        c.run()
    rolls = c.kv_rolls()
    assert len(rolls) == len(start_rolls) + 1, rolls
    assert key in c.status["handledTerminations"]
    assert "pendingRemediation" not in c.status
    assert len(c.status["remediations"]) == 1
    rid = c.status["remediations"][0]["revision"]
    assert c.deployment is not None
    assert c.deployment["metadata"]["annotations"][REMEDIATION_ID_ANNOTATION] == rid
    # One Event for the remediation, whichever pass posted it.
    assert [k for k in c.events if k == rid] == [rid]


# --------------------------------------------------------------------------------------------
# Small pure pieces


def test_after_apply_bumps_the_generation_only_when_the_spec_changes() -> None:
    c = running()
    live = c.deployment
    assert live is not None
    same = reconcile.after_apply(live, copy.deepcopy(live))
    assert same["metadata"]["generation"] == live["metadata"]["generation"]
    changed = copy.deepcopy(live)
    changed["spec"]["replicas"] = 2
    assert (
        reconcile.after_apply(live, changed)["metadata"]["generation"] == live["metadata"]["generation"] + 1
    )
    first = reconcile.after_apply(None, changed)
    assert first["metadata"]["generation"] == 1 and first["status"] == {}


def test_state_reads_a_hand_edited_status_without_crashing() -> None:
    s = reconcile.ServiceState.from_status(
        {
            "servingFlags": {"kvCacheMemoryBytes": -1},
            "handledTerminations": "not a list",
            "remediations": [1, "x", {"time": "bad"}],
            "pendingRemediation": {"id": 7},
            "lowHeadroomSince": "yesterday",
            "observedGeneration": True,
        }
    )
    assert s.serving_flags is None and s.handled == () and s.pending is None
    assert s.low_headroom_since is None and s.observed_generation is None
    assert len(s.history) == 1  # kept as written; history_from_status skips what it cannot read


@pytest.mark.parametrize("name", ["a" * 63, "b" * 64, "c" * 253])
def test_pods_of_a_long_named_service_are_found_under_the_index_key(name: str) -> None:
    """Before: render truncated the pod label while the loop looked pods up by the full name,
    so a service named over 63 characters never saw its pods."""
    body = reconcile.step(
        reconcile.ServiceState(),
        reconcile.World(name=name, namespace="ns", uid="u", generation=1, spec=SPEC, now=T0, new_id="r"),
        SETTINGS,
    )
    [apply] = [e for e in body.effects if isinstance(e, reconcile.ApplyDeployment)]
    pod_labels = apply.body["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["rankguard.io/llmservice"] == label_value(name)
    assert len(label_value(name)) <= 63
    assert deployment_template_hash(apply.body) is not None


def _vllm_argv(deployment: Mapping[str, Any]) -> list[str]:
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    return list(command[command.index("vllm") + 1 :])


def test_without_gpu_memory_bytes_the_gpu_size_is_learned_and_the_startup_check_fits() -> None:
    """Nobody types the GPU's size: the agents' first report gives it, status keeps it, and the
    byte budget that follows is rendered with a start-up utilisation that fits the card."""
    c = Cluster()
    del c.spec["memory"]
    c.run()
    assert c.deployment is not None
    assert "--kv-cache-memory-bytes" not in _vllm_argv(c.deployment)  # no size, no plan yet
    c.controller_done()
    small = 24 * GiB

    def small_card_report(at: float) -> Report:
        r = report((12 * GiB, 12 * GiB), at)
        return replace(
            r, ranks=[replace(s, total_bytes=small, used_bytes=small - s.free_bytes) for s in r.ranks]
        )

    pod_name = c.pods[0]["metadata"]["name"]
    for _ in range(3):
        c.run(reports=((pod_name, small_card_report(c.clock), c.clock),))
        c.controller_done()
    assert c.status["gpuMemoryBytes"] == small
    argv = _vllm_argv(c.deployment)
    assert "--kv-cache-memory-bytes" in argv, argv
    util = float(argv[argv.index("--gpu-memory-utilization") + 1])
    kv = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    assert kv / small < util < 0.92  # what vLLM will use, not its default 0.92 of the card
    # the learned size survives a restart of the operator: it is read back from status
    assert c.state().gpu_memory_bytes == small


def _with_engine(r: Report, *, version: str | None, rank0_others: int) -> Report:
    """The report of a first start in utilisation mode: vLLM printed its per-worker memory report
    (another CUDA context held `rank0_others` bytes on GPU 0 when the workers started)."""
    from rankguard_agent.report import EngineMemory

    def mem(rank: int) -> EngineMemory:
        return EngineMemory(
            consumed_bytes=9 * GiB,
            peak_activation_bytes=2 * GiB,
            cuda_graph_bytes=GiB // 2,
            kv_in_use_bytes=60 * GiB,
            free_at_start_bytes=80 * GiB - (rank0_others if rank == 0 else 0) - GiB // 4,
            total_bytes=80 * GiB,
            requested_bytes=int(80 * GiB * 0.92),
        )

    return replace(r, engine_version=version, ranks=[replace(s, engine_memory=mem(s.rank)) for s in r.ranks])


def test_the_engines_own_report_tightens_the_plan_and_survives_a_restart_without_it() -> None:
    c = running()
    pod_name = c.pods[0]["metadata"]["name"]
    before = c.state()
    c.run(
        reports=(
            (
                pod_name,
                _with_engine(report((20 * GiB, 20 * GiB), c.clock), version="0.33.0", rank0_others=6 * GiB),
                c.clock,
            ),
        )
    )
    engine = c.status["engine"]
    assert (
        engine["version"] == "0.33.0" and engine["versionSource"] == "agent" and engine["rules"] == "0.33.0"
    )
    rows = {r["rank"]: r for r in engine["ranks"]}
    # others' 6.25 GiB on GPU 0 + 9 + 2 + 0.5 GiB of the worker's own: the engine's figure
    assert rows[0]["nonKVBytes"] == 6 * GiB + GiB // 4 + 9 * GiB + 2 * GiB + GiB // 2
    assert rows[1]["nonKVBytes"] == GiB // 4 + 9 * GiB + 2 * GiB + GiB // 2
    rules = next(x for x in c.status["conditions"] if x["type"] == "EngineRules")
    assert (rules["status"], rules["reason"]) == ("True", "Recorded")
    assert before.engine_non_kv == {} and c.state().engine_non_kv == {
        0: rows[0]["nonKVBytes"],
        1: rows[1]["nonKVBytes"],
    }
    # the bottleneck's engine figure (others' memory on GPU 0 included) tightens the plan
    from rankguard_operator.core.budget import measured_plan
    from rankguard_operator.core.headroom import aggregate

    obs = aggregate([(pod_name, report((20 * GiB, 20 * GiB), c.clock), c.clock)], c.clock, 30.0)
    spec = parse_spec(SPEC)
    with_engine = measured_plan(spec, obs, engine_non_kv=c.state().engine_non_kv)
    without = measured_plan(spec, obs)
    assert with_engine is not None and without is not None
    assert with_engine.ranks[0].non_kv_source == "engine"
    assert with_engine.kv_cache_memory_bytes < without.kv_cache_memory_bytes
    # a later pod (byte budget: vLLM prints no report) keeps the figures from status
    c.run(reports=((pod_name, report((20 * GiB, 20 * GiB), c.clock), c.clock),))
    assert c.state().engine_non_kv[0] == rows[0]["nonKVBytes"]


def test_an_unknown_engine_version_falls_back_to_the_nearest_snapshot_and_says_so() -> None:
    c = running()
    pod_name = c.pods[0]["metadata"]["name"]
    r = _with_engine(report((20 * GiB, 20 * GiB), c.clock), version="0.99.1", rank0_others=0)
    step = c.run(reports=((pod_name, r, c.clock),))
    assert step.decision is not None  # the operator carries on
    rules = next(x for x in c.status["conditions"] if x["type"] == "EngineRules")
    assert (rules["status"], rules["reason"]) == ("False", "NearestSnapshot")
    assert "0.99.1" in rules["message"] and "0.33.0" in rules["message"]
    assert c.status["engine"]["rules"] == "0.33.0"


def test_a_start_up_refusal_teaches_the_gpu_size_when_no_report_could() -> None:
    """vLLM's start-up check refuses a small card under TP before the pod is ever ready (no
    report to scrape): the termination message's device total is learned, and the roll that
    follows carries a start-up utilisation that fits."""
    c = Cluster()
    del c.spec["memory"]
    c.run()
    c.controller_done()
    p = c.pods[0]
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=1,
        gpu_index=1,
        requested_bytes=int(15 * GiB * 0.92),
        free_bytes=13 * GiB,
        total_bytes=15 * GiB,
        detail="vLLM refused to start: its start-up memory check failed on cuda:1",
    ).to_json()
    term = {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}
    c.pods = [pod(p["metadata"]["name"], p["metadata"]["annotations"], ready=False, terminated=term)]
    c.run()
    assert c.status["gpuMemoryBytes"] == 15 * GiB
    argv = _vllm_argv(c.deployment)
    assert "--kv-cache-memory-bytes" in argv, argv
    assert float(argv[argv.index("--gpu-memory-utilization") + 1]) < 13 / 15


def test_a_start_up_refusal_under_a_byte_budget_keeps_the_budget_and_lowers_the_checked_share() -> None:
    """vLLM's start-up check compares free memory with the utilisation rendered next to the
    budget, not with the budget: the budget stays, and the utilisation drops under what vLLM
    measured (kept in status, so the next render and a restarted operator agree)."""
    c = running()
    before = flags_of(c.deployment)
    util_before = float(
        _vllm_argv(c.deployment)[_vllm_argv(c.deployment).index("--gpu-memory-utilization") + 1]
    )
    p = c.pods[0]
    free = int(util_before * 80 * GiB) - 3 * GiB
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=0,
        gpu_index=0,
        requested_bytes=int(util_before * 80 * GiB),
        free_bytes=free,
        total_bytes=80 * GiB,
        detail="vLLM refused to start: its start-up memory check failed on cuda:0",
        startup_check=True,
    ).to_json()
    term = {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}
    c.pods = [pod(p["metadata"]["name"], p["metadata"]["annotations"], ready=False, terminated=term)]
    step = c.run()
    assert step.decision is not None and step.decision.reason == "StartupCheckRefused"
    assert flags_of(c.deployment) == before  # the KV budget stays
    argv = _vllm_argv(c.deployment)
    util = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert util * 80 * GiB <= free - 512 * 1024 * 1024
    assert c.status["engine"]["startupFreeBytes"] == free
    assert any(e.reason == "StartupCheckRefused" for e in c.events.values())
    assert not c.status.get("remediations")  # no budget change to record
    # a restarted operator renders the same thing: nothing more to roll
    applies = len(c.applies)
    c.controller_done()
    c.run()
    assert len(c.applies) == applies


def test_engine_lines_the_agents_could_not_read_are_said_in_the_condition() -> None:
    c = running()
    pod_name = c.pods[0]["metadata"]["name"]
    r = replace(report((20 * GiB, 20 * GiB), c.clock), engine_version="0.33.0")
    r = replace(r, unparsed_lines={"worker_memory_report": 2})
    step = c.run(reports=((pod_name, r, c.clock),))
    assert step.decision is not None
    rules = next(x for x in c.status["conditions"] if x["type"] == "EngineRules")
    assert (rules["status"], rules["reason"]) == ("False", "UnreadEngineLines")
    assert "worker_memory_report 2" in rules["message"]
    assert "engine" in c.status and "ranks" not in c.status["engine"]  # nothing unread is used
