"""Observations from real-shaped API objects: terminations (and their dedup keys), readiness, rollouts."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rankguard_agent.wire.termination import TerminationMessage
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.names import FLAGS_ANNOTATION, TEMPLATE_HASH_ANNOTATION
from rankguard_operator.core.observe.pods import (
    carried_template_hash,
    new_terminations,
    pod_flags,
    pod_ip,
    pod_ready,
    rollout_state,
    terminations,
)
from rankguard_operator.core.units import GiB, MiB, iso, parse_iso

GIB_2 = 2 * GiB
OOM_JSON = TerminationMessage(
    reason="CUDAOutOfMemory",
    exit_code=1,
    rank=2,
    gpu_index=2,
    requested_bytes=GIB_2,
    free_bytes=512 * MiB,
    total_bytes=80 * GiB,
    last_kv_line="INFO 11-29 21:50:01 [gpu_worker.py:298] Available KV cache memory: 37.68 GiB",
    detail="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
).to_json()

# What FallbackToLogsOnError leaves when the launcher itself could not write its message.
LOG_TAIL_OOM = (
    "(Worker_TP1 pid=812) INFO 11-29 21:50:01 [gpu_model_runner.py:2600] Capturing CUDA graphs\n"
    "(Worker_TP1 pid=812) ERROR 11-29 21:50:02 [multiproc_executor.py:600] torch.OutOfMemoryError: CUDA out "
    "of memory. Tried to allocate 1.50 GiB. GPU 1 has a total capacity of 79.19 GiB of which 1.00 GiB is "
    "free. Including non-PyTorch memory, this process has 78.18 GiB memory in use.\n"
)


def pod(
    *,
    restart_count: int = 1,
    last: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the API returns it (only the fields that matter, shaped as the kubelet writes them)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llama-6f7d9c-abcde",
            "namespace": "serving",
            "uid": "7c1e-uid",
            "annotations": annotations
            if annotations is not None
            else {TEMPLATE_HASH_ANNOTATION: "a2932e7b7c4f3e67"},
        },
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": "False"},
                {"type": "ContainersReady", "status": "False"},
                {"type": "PodScheduled", "status": "True"},
            ],
            "containerStatuses": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.33.0",
                    "ready": False,
                    "restartCount": restart_count,
                    "started": False,
                    "state": state if state is not None else {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": last if last is not None else {},
                }
            ],
        },
    }


def terminated(message: str | None, *, reason: str = "Error", exit_code: int = 1) -> dict[str, Any]:
    t: dict[str, Any] = {
        "terminated": {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": "2026-11-29T21:46:00Z",
            "finishedAt": "2026-11-29T21:50:02Z",
            "containerID": "containerd://deadbeef",
        }
    }
    if message is not None:
        t["terminated"]["message"] = message
    return t


def test_cuda_oom_termination_message_in_last_state() -> None:
    (t,) = terminations(pod(restart_count=1, last=terminated(OOM_JSON)))
    assert (t.pod_name, t.pod_uid, t.container, t.restart_count) == (
        "llama-6f7d9c-abcde",
        "7c1e-uid",
        "vllm",
        0,
    )
    assert (t.kind, t.exit_code, t.rank) == ("CUDAOutOfMemory", 1, 2)
    assert (t.requested_bytes, t.free_bytes, t.total_bytes) == (GIB_2, 512 * MiB, 80 * GiB)
    assert t.deficit_bytes == GIB_2 - 512 * MiB
    assert t.kv_cache_bytes == round(37.68 * GiB)
    assert t.finished_at == parse_iso("2026-11-29T21:50:02Z") == 1795989002.0
    assert t.key == "7c1e-uid/vllm/0"
    assert "CUDA out of memory" in t.message


def test_the_same_run_has_one_key_in_state_and_in_last_state() -> None:
    """Before the restart the kubelet shows the run in state.terminated (restartCount N); after it,
    in lastState.terminated (restartCount N+1). Delivered both ways, it must be handled once."""
    before = terminations(pod(restart_count=3, state=terminated(OOM_JSON)))
    after = terminations(pod(restart_count=4, last=terminated(OOM_JSON), state={"running": {}}))
    assert [t.key for t in before] == [t.key for t in after] == ["7c1e-uid/vllm/3"]
    both = terminations(pod(restart_count=4, last=terminated(OOM_JSON), state=terminated(OOM_JSON)))
    assert [t.key for t in both] == ["7c1e-uid/vllm/3", "7c1e-uid/vllm/4"]


def test_oom_killed_wins_over_the_launchers_message() -> None:
    signaled = TerminationMessage(reason="Signaled", exit_code=137, signal=9).to_json()
    (t,) = terminations(pod(last=terminated(signaled, reason="OOMKilled", exit_code=137)))
    assert (t.kind, t.reason, t.exit_code) == ("OOMKilled", "OOMKilled", 137)
    (t2,) = terminations(pod(last=terminated(None, reason="OOMKilled", exit_code=137)))
    assert t2.kind == "OOMKilled" and "OOMKilled" in t2.message and t2.phase is None
    # the launcher's phase (where the engine was when the kernel killed it) is kept
    staged = TerminationMessage(reason="Signaled", exit_code=137, signal=9, phase="weights").to_json()
    (t3,) = terminations(pod(last=terminated(staged, reason="OOMKilled", exit_code=137)))
    assert (t3.kind, t3.phase) == ("OOMKilled", "weights")


KIND_IDS = ["log-oom", "log-error", "sigterm", "completed", "json-engine", "json-kv", "json-signal"]
KIND_IDS += ["json-done", "log-kv"]


@pytest.mark.parametrize(
    ("message", "reason", "exit_code", "kind"),
    [
        (LOG_TAIL_OOM, "Error", 1, "CUDAOutOfMemory"),
        ("Traceback (most recent call last):\nValueError: bad config\n", "Error", 1, "EngineError"),
        ("INFO shutting down\n", "Error", 143, "Other"),
        ("", "Completed", 0, "Other"),
        (TerminationMessage(reason="EngineError", exit_code=3).to_json(), "Error", 3, "EngineError"),
        (TerminationMessage(reason="KVCacheTooSmall", exit_code=1).to_json(), "Error", 1, "KVCacheTooSmall"),
        (TerminationMessage(reason="Signaled", exit_code=143, signal=15).to_json(), "Error", 143, "Other"),
        (TerminationMessage(reason="Completed", exit_code=0).to_json(), "Completed", 0, "Other"),
        (
            "ERROR ... To serve at least one request with the models's max seq len (131072), (16.00 GiB KV "
            "cache is needed, which is larger than the available KV cache memory (9.50 GiB).",
            "Error",
            1,
            "KVCacheTooSmall",
        ),
    ],
    ids=KIND_IDS,
)
def test_kind_from_message_or_reason(message: str, reason: str, exit_code: int, kind: str) -> None:
    (t,) = terminations(pod(last=terminated(message, reason=reason, exit_code=exit_code)))
    assert t.kind == kind


def test_log_tail_oom_keeps_the_figures() -> None:
    (t,) = terminations(pod(last=terminated(LOG_TAIL_OOM)))
    assert (t.rank, t.requested_bytes, t.free_bytes) == (1, round(1.5 * GiB), GiB)
    assert t.total_bytes == round(79.19 * GiB)


def test_flags_and_hash_come_from_the_pod_annotations() -> None:
    ann = {
        TEMPLATE_HASH_ANNOTATION: "h1",
        FLAGS_ANNOTATION: '{"kvCacheMemoryBytes":1000,"memoryLimit":"64Gi"}',
    }
    p = pod(last=terminated(OOM_JSON), annotations=ann)
    flags = ServingFlags(kv_cache_memory_bytes=1000, memory_limit_bytes=64 * GiB)
    assert pod_flags(p) == flags and carried_template_hash(p) == "h1"
    assert terminations(p)[0].flags == flags
    bad = pod(annotations={FLAGS_ANNOTATION: "{not json"})
    assert pod_flags(bad) is None and carried_template_hash(bad) is None


def test_nothing_to_report() -> None:
    assert terminations(pod(restart_count=0)) == []
    other = pod(last=terminated(OOM_JSON))
    other["status"]["containerStatuses"][0]["name"] = "sidecar"
    assert terminations(other) == []
    assert terminations({"metadata": {"uid": "x"}}) == []
    assert terminations({}) == []


def test_new_terminations_dedups_across_pods_and_the_seen_set() -> None:
    a = pod(restart_count=1, last=terminated(OOM_JSON))
    b = copy.deepcopy(a)
    b["metadata"]["uid"] = "other-uid"
    b["status"]["containerStatuses"][0]["lastState"]["terminated"]["finishedAt"] = "2026-11-29T21:40:00Z"
    got = new_terminations([a, b, a], seen=set())
    assert [t.key for t in got] == ["other-uid/vllm/0", "7c1e-uid/vllm/0"]  # oldest first, each once
    assert [t.key for t in new_terminations([a, b], seen={"7c1e-uid/vllm/0"})] == ["other-uid/vllm/0"]


def test_readiness_and_ip() -> None:
    p = pod()
    assert not pod_ready(p) and pod_ip(p) == "10.1.2.3"
    p["status"]["conditions"][1]["status"] = "True"
    assert pod_ready(p)
    p["metadata"]["deletionTimestamp"] = "2026-11-29T21:55:00Z"
    assert not pod_ready(p)
    assert pod_ip({"status": {}}) is None and not pod_ready({})


def test_time_round_trip() -> None:
    assert iso(1795989002.7) == "2026-11-29T21:50:02Z"
    assert parse_iso("2026-11-29T21:50:02Z") == 1795989002.0
    assert parse_iso("2026-11-29T22:50:02+01:00") == 1795989002.0
    assert parse_iso("yesterday") is None and parse_iso(None) is None and parse_iso("") is None


# --- rollouts -----------------------------------------------------------------------------------


def deployment(
    *,
    hash_: str = "h1",
    generation: int = 2,
    observed: int = 2,
    replicas: int = 2,
    status: dict[str, Any] | None = None,
    conditions: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    st = {"observedGeneration": observed, "conditions": conditions or []}
    st.update(status or {})
    return {
        "metadata": {"name": "llama", "generation": generation},
        "spec": {
            "replicas": replicas,
            "template": {"metadata": {"annotations": {TEMPLATE_HASH_ANNOTATION: hash_}}},
        },
        "status": st,
    }


DONE = {"replicas": 2, "updatedReplicas": 2, "readyReplicas": 2, "availableReplicas": 2}
DEADLINE = {
    "type": "Progressing",
    "status": "False",
    "reason": "ProgressDeadlineExceeded",
    "message": 'ReplicaSet "llama-6f7d9c" has timed out progressing.',
}


ROLLOUT_IDS = ["missing", "old-template", "not-observed", "deadline", "updating", "old-pods", "unavailable"]
ROLLOUT_IDS += ["done", "zero"]


@pytest.mark.parametrize(
    ("dep", "phase", "reason"),
    [
        (None, "unknown", "NotFound"),
        (deployment(hash_="old", status=DONE), "unknown", "TemplateNotApplied"),
        (deployment(observed=1, status=DONE), "progressing", "NotObserved"),
        (deployment(status=DONE, conditions=[DEADLINE]), "failed", "ProgressDeadlineExceeded"),
        (deployment(status={**DONE, "updatedReplicas": 1}), "progressing", "Progressing"),
        (deployment(status={**DONE, "replicas": 3}), "progressing", "Progressing"),
        (deployment(status={**DONE, "availableReplicas": 1}), "progressing", "Progressing"),
        (deployment(status=DONE), "complete", "Complete"),
        (deployment(replicas=0, status={}), "complete", "Complete"),
    ],
    ids=ROLLOUT_IDS,
)
def test_rollout_state(dep: dict[str, Any] | None, phase: str, reason: str) -> None:
    r = rollout_state(dep, "h1")
    assert (r.phase, r.reason) == (phase, reason)
    assert r.complete == (phase == "complete") and r.failed == (phase == "failed")


def test_rollout_counts_and_messages() -> None:
    r = rollout_state(deployment(status={**DONE, "updatedReplicas": 1, "availableReplicas": 1}), "h1")
    assert (r.replicas, r.updated_replicas, r.available_replicas, r.ready_replicas) == (2, 1, 1, 2)
    assert r.message == "1 of 2 replicas updated"
    failed = rollout_state(deployment(status=DONE, conditions=[DEADLINE]), "h1")
    assert "timed out progressing" in failed.message
    # a stale deadline condition from an older generation is not this rollout's failure
    assert (
        rollout_state(deployment(observed=1, status=DONE, conditions=[DEADLINE]), "h1").phase == "progressing"
    )


# What the kubelet keeps of a launcher killed by SIGKILL: no message of its own, so the log tail,
# whose last line is whatever the agent logged last (issue 50: quoted as an engine error).
AGENT_TAIL = "rankguard-agent INFO 12-01 12:51:46 serving /report on :9400 (4 ranks)\n"


def test_a_sigkilled_launcher_is_said_as_what_it_is_not_by_its_last_log_line() -> None:
    (t,) = terminations(pod(last=terminated(AGENT_TAIL, reason="Error", exit_code=137)))
    assert (t.kind, t.exit_code, t.message) == ("EngineError", 137, "killed by SIGKILL (exit 137)")
    assert t.sigkilled
    # the kernel's OOM killer is the kubelet's own reason, and stays what it is
    (oom,) = terminations(pod(last=terminated(AGENT_TAIL, reason="OOMKilled", exit_code=137)))
    assert oom.kind == "OOMKilled" and not oom.sigkilled
    # a CUDA OOM in the tail is still the cause it names
    (cuda,) = terminations(pod(last=terminated(LOG_TAIL_OOM, reason="Error", exit_code=137)))
    assert cuda.kind == "CUDAOutOfMemory"
