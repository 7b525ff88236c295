"""Every OOM gets the lever that fixes it (issue 27, docs/remediation.md), end to end.

One simulated node per phase scenario (sim/rankguard_sim/scenarios/oom-*.yaml, docs/scenarios.md),
each with one LLMService pinned to it, all applied at once in one namespace so the seven stories
run side by side (one sandbox, not seven: the e2e tier's time). Each test then waits for its
own service: the fake vLLM runs out of memory in that scenario's phase, the agent says which, the
operator moves that phase's lever (and no other), and the engine, restarted with the new flag,
starts and serves because the world's memory physics make that lever work. The weights story ends
Degraded with nothing rolled; two stories escalate (the first lever did not fix it).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.engine.serving_flags import LEVER_KEYS as FLAG_KEYS
from rankguard_operator.core.policy.history import STATUS_ACTIONS
from rankguard_operator.core.policy.oom_levers import ACTIONS
from rankguard_operator.core.policy.tunables import (
    LEVER_BATCHED,
    LEVER_CAPTURE,
    LEVER_EAGER,
    LEVER_FIELDS,
    LEVER_KV,
    LEVER_SEQS,
    T_CUDA_OOM,
)
from rankguard_sim.world import OperatorProcess
from tests.builders import llmservice

from .conftest import (
    Sandbox,
    condition,
    get_llmservice,
    side_by_side,
    wait_for,
)

pytestmark = pytest.mark.e2e

GiB = 2**30
# status.servingFlags / fromFlags / toFlags key of each lever (the CRD's names), as the operator maps them
LEVER_KEYS = {lever: FLAG_KEYS.get(field, "kvCacheMemoryBytes") for lever, field in LEVER_FIELDS.items()}
TRIGGER = T_CUDA_OOM


@dataclass(frozen=True)
class Story:
    scenario: str
    engine: dict[str, Any]  # spec.engine: the scenario's own batch limits, which it is about
    remediation: dict[str, Any]


STORIES = {
    "weights": Story("oom-weights", {"maxModelLen": 8192}, {}),
    # 65,536 batched tokens: the profile run's peak that does not fit next to the weights
    "profile": Story("oom-profile", {"maxModelLen": 8192, "maxNumBatchedTokens": 65536}, {}),
    "kv": Story("oom-kv-allocation", {"maxModelLen": 8192}, {}),
    # the floor that makes cutting the KV budget by the capture's deficit not an option
    "graphs": Story("oom-cuda-graphs", {"maxModelLen": 8192}, {"minKVCacheBytes": int(4.5 * GiB)}),
    "eager": Story("oom-cuda-graphs-eager", {"maxModelLen": 8192}, {"minKVCacheBytes": int(4.5 * GiB)}),
    "sampler": Story("oom-sampler-warmup", {"maxModelLen": 8192}, {}),
    "serving": Story(
        "oom-serving", {"maxModelLen": 8192, "maxNumSeqs": 1024, "maxNumBatchedTokens": 2048}, {}
    ),
}
MODELS = {"oom-weights": "meta-llama/Meta-Llama-3-70B-Instruct"}


@pytest.fixture(scope="module")
def phases(
    api: client.ApiClient, operator_process: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Sandbox]:
    """The seven nodes and services, started together; each test reads its own."""
    stories = {
        key: (story.scenario, functools.partial(_service, key, story)) for key, story in STORIES.items()
    }
    namespace = f"e2e-phases-{uuid.uuid4().hex[:6]}"
    with side_by_side(api, tmp_path_factory.mktemp("phases"), namespace, stories) as box:
        yield box


def _service(key: str, story: Story, node: str) -> dict[str, Any]:
    return llmservice(
        key,
        {
            "model": {"name": MODELS.get(story.scenario, "meta-llama/Meta-Llama-3-8B-Instruct")},
            "image": "vllm/vllm-openai:v0.33.0",
            "tensorParallelSize": 1,
            "engine": story.engine,
            # start where vLLM starts (its default utilisation) and stay there until an OOM says
            # otherwise: with a starting utilisation rankguard does not replace it by its plan
            # before the first crash (rule_replan), so each phase's OOM happens as the scenario
            # describes it, not sooner or never because of a race with the first measurement
            # (and no growing back afterwards: that is reclaim's story, not this one)
            "memory": {"gpuMemoryUtilization": 0.92, "reclaim": False},
            # no cool-down: each story is a start-up OOM (or one under the first load), and the
            # escalations need the second move at once
            "remediation": {"cooldownSeconds": 0, **story.remediation},
            # its own node: each scenario is one node's GPUs
            "template": {"spec": {"nodeSelector": {"kubernetes.io/hostname": node}}},
        },
    )


def _ooms(svc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in (svc.get("status") or {}).get("remediations") or [] if r["trigger"] == TRIGGER]


def _lever_story(
    box: Sandbox, key: str, phase: str, levers: list[str], timeout: float = 280
) -> dict[str, Any]:
    """Wait for `key` to be Ready after exactly `levers` moved (in that order, for `phase`), then
    check that each move changed its lever's flag and nothing else, and that an Event names it."""

    def fixed_and_ready() -> dict[str, Any] | None:
        svc = get_llmservice(box.api, box.namespace, key)
        ready = condition(svc, "Ready")
        st = svc.get("status") or {}
        if ready and ready["status"] == "True" and st.get("ranks") and len(_ooms(svc)) >= len(levers):
            return svc
        return None

    svc = wait_for(
        f"{key}: {' then '.join(levers)} moved and Ready",
        fixed_and_ready,
        timeout,
        dump=lambda: get_llmservice(box.api, box.namespace, key).get("status"),
    )
    ooms = _ooms(svc)
    assert [(r.get("phase"), r.get("lever")) for r in ooms] == [(phase, lv) for lv in levers], ooms
    for r in ooms:
        key_ = LEVER_KEYS[r["lever"]]
        frm, to = r.get("fromFlags") or {}, r["toFlags"]
        # the lever's flag moved, down (or eager on) ...
        assert to.get(key_) is not None and to.get(key_) != frm.get(key_), r
        # ... and no other lever did (the first KV move turns a utilisation into bytes)
        others = [k for k in LEVER_KEYS.values() if k != key_]
        assert {k: frm.get(k) for k in others if k != "kvCacheMemoryBytes"} == {
            k: to.get(k) for k in others if k != "kvCacheMemoryBytes"
        }, r
        if r["lever"] != LEVER_KV:
            assert frm.get("kvCacheMemoryBytes") == to.get("kvCacheMemoryBytes"), r
            assert frm.get("gpuMemoryUtilization") == to.get("gpuMemoryUtilization"), r
    # what serves is the last move (a later low-headroom shrink under load would be the last one)
    st = svc["status"]
    assert st["servingFlags"] == st["remediations"][-1]["toFlags"]
    if levers[-1] != LEVER_KV:
        key_ = LEVER_KEYS[levers[-1]]
        assert st["servingFlags"][key_] == ooms[-1]["toFlags"][key_]
    # an Event per move, with the action's reason, naming the rank, the phase's words and the lever
    events = client.CoreV1Api(box.api).list_namespaced_event(
        box.namespace, field_selector=f"involvedObject.name={key},involvedObject.kind=LLMService"
    )
    for lever in levers:
        reason = STATUS_ACTIONS[ACTIONS[lever]]
        said = [e.message or "" for e in events.items if e.reason == reason]
        assert any(f"lever {lever}" in m and "rank 0" in m for m in said), (reason, said)
    return svc


def _args(box: Sandbox, key: str) -> list[str]:
    dep = client.AppsV1Api(box.api).read_namespaced_deployment(key, box.namespace)
    vllm = next(c for c in dep.spec.template.spec.containers if c.name == "vllm")
    return [*(vllm.command or []), *(vllm.args or [])]


def _flag(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def test_a_profile_run_oom_lowers_the_batched_tokens_and_keeps_the_kv_budget(phases: Sandbox) -> None:
    svc = _lever_story(phases, "profile", tm.PHASE_PROFILE, [LEVER_BATCHED])
    [r] = _ooms(svc)
    assert (r["from"], r["to"]) == (65536, 32768)
    assert _flag(_args(phases, "profile"), "--max-num-batched-tokens") == "32768"


def test_a_kv_allocation_oom_cuts_the_kv_budget(phases: Sandbox) -> None:
    svc = _lever_story(phases, "kv", tm.PHASE_KV_ALLOCATION, [LEVER_KV])
    [r] = _ooms(svc)
    assert r["toFlags"]["kvCacheMemoryBytes"] < 0.92 * 23.58 * GiB
    assert _flag(_args(phases, "kv"), "--kv-cache-memory-bytes") == str(
        svc["status"]["servingFlags"]["kvCacheMemoryBytes"]
    )


def test_a_cuda_graph_oom_halves_the_capture_size_when_the_kv_floor_forbids_a_cut(phases: Sandbox) -> None:
    svc = _lever_story(phases, "graphs", tm.PHASE_CUDA_GRAPHS, [LEVER_CAPTURE])
    [r] = _ooms(svc)
    assert (r["from"], r["to"]) == (512, 256)  # vLLM 0.33's default ceiling, halved
    assert "the KV budget would drop to" in r["message"]  # why the cheaper lever was passed over
    argv = _args(phases, "graphs")
    assert _flag(argv, "--max-cudagraph-capture-size") == "256" and "--enforce-eager" not in argv


def test_a_capture_that_fails_at_every_size_escalates_to_enforce_eager(phases: Sandbox) -> None:
    _lever_story(phases, "eager", tm.PHASE_CUDA_GRAPHS, [LEVER_CAPTURE, LEVER_EAGER])
    assert "--enforce-eager" in _args(phases, "eager")


def test_a_sampler_warmup_oom_cuts_the_kv_budget(phases: Sandbox) -> None:
    svc = _lever_story(phases, "sampler", tm.PHASE_SAMPLER_WARMUP, [LEVER_KV])
    argv = _args(phases, "sampler")
    assert _flag(argv, "--max-num-seqs") == "256"  # the spec's, untouched
    assert _flag(argv, "--kv-cache-memory-bytes") == str(svc["status"]["servingFlags"]["kvCacheMemoryBytes"])


def test_an_oom_under_load_that_a_kv_cut_does_not_fix_escalates_to_fewer_sequences(phases: Sandbox) -> None:
    svc = _lever_story(phases, "serving", tm.PHASE_SERVING, [LEVER_KV, LEVER_SEQS])
    seqs = _ooms(svc)[-1]
    assert (seqs["from"], seqs["to"]) == (1024, 512)
    assert _flag(_args(phases, "serving"), "--max-num-seqs") == "512"


def test_weights_that_do_not_fit_end_degraded_without_a_roll(phases: Sandbox) -> None:
    box = phases

    def degraded() -> dict[str, Any] | None:
        svc = get_llmservice(box.api, box.namespace, "weights")
        c = condition(svc, "Degraded")
        return svc if c and c["status"] == "True" and c.get("reason") == "WeightsDoNotFit" else None

    svc = wait_for(
        "weights: Degraded WeightsDoNotFit",
        degraded,
        280,
        dump=lambda: get_llmservice(box.api, box.namespace, "weights").get("status"),
    )
    msg = condition(svc, "Degraded")["message"]  # type: ignore[index]
    assert "spec.tensorParallelSize 2 would fit" in msg, msg
    assert msg.startswith("rank 0 ran out of GPU memory"), msg
    assert "while loading the weights" in msg and "rolls nothing" in msg, msg
    # no flag changed: nothing in the history
    assert not svc["status"].get("remediations"), svc["status"]["remediations"]
    # nothing rolled: the Deployment still has the one ReplicaSet (pod template) it started with
    sets = client.AppsV1Api(box.api).list_namespaced_replica_set(box.namespace).items
    mine = [s for s in sets if any(o.name == "weights" for o in s.metadata.owner_references or [])]
    assert len(mine) == 1, [s.metadata.name for s in mine]
