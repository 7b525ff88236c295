"""Across modules: a run the image's own vLLM refused (issue 51), read from pods as the kubelet
reports them: the termination's kind, the refused run while the pod waits in back-off, the
rollout that carries it, and the pod blocker that says it as the refusal, never as a crash loop."""

from __future__ import annotations

from typing import Any

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.names import TEMPLATE_HASH_ANNOTATION
from rankguard_operator.core.observe import pod_blockers as pb
from rankguard_operator.core.observe.pods import (
    ENGINE_ERROR,
    ENGINE_REFUSED,
    FAILURE_KINDS,
    refused_run,
    rollout_state,
    terminations,
)
from tests.unit.core.observe.test_pods import DONE, deployment, pod, terminated

VLLM_SAYS = (
    "vllm serve: error: argument --runner: invalid choice: 'poolin' "
    "(choose from 'auto', 'draft', 'generate', 'pooling')"
)
REFUSED = tm.TerminationMessage(reason=tm.ENGINE_REFUSED, exit_code=2, detail=VLLM_SAYS).to_json()
T = 1_800_000_000.0


def back_off(message: str = REFUSED, *, hash_: str = "h1") -> dict[str, Any]:
    """A pod whose vLLM's latest run ended with `message` and waits in CrashLoopBackOff."""
    return pod(last=terminated(message, exit_code=2), annotations={TEMPLATE_HASH_ANNOTATION: hash_})


def test_the_agents_record_reads_as_a_refusal_not_an_engine_error() -> None:
    (t,) = terminations(back_off())
    assert (t.kind, t.exit_code, t.message, t.template_hash) == (ENGINE_REFUSED, 2, VLLM_SAYS, "h1")
    # a refusal is not a failure of the flags: no remediation rule reads it
    assert ENGINE_REFUSED not in FAILURE_KINDS
    # the same exit code with an engine error's record stays what it was
    other = tm.TerminationMessage(reason=tm.ENGINE_ERROR, exit_code=2, detail="ValueError: x").to_json()
    assert terminations(back_off(other))[0].kind == ENGINE_ERROR


def test_a_refused_run_holds_while_the_pod_waits_and_goes_when_it_runs() -> None:
    waiting = back_off()
    assert refused_run(waiting) is not None
    # just ended, not yet restarted: the run in `state` is the latest
    ended = pod(restart_count=0, state=terminated(REFUSED, exit_code=2))
    r = refused_run(ended)
    assert r is not None and r.restart_count == 0
    # running again (the kubelet restarted it; vLLM judges it anew): nothing to say now
    assert refused_run(pod(last=terminated(REFUSED, exit_code=2), state={"running": {}})) is None
    # the latest run ended otherwise
    crashed = tm.TerminationMessage(reason=tm.ENGINE_ERROR, exit_code=1, detail="RuntimeError: x").to_json()
    assert refused_run(back_off(crashed)) is None
    # a pod being deleted speaks for nothing
    gone = back_off()
    gone["metadata"]["deletionTimestamp"] = "2026-11-29T21:51:00Z"
    assert refused_run(gone) is None


def test_the_rollout_carries_a_refused_pod_of_its_own_template_only() -> None:
    dep = deployment(status={**DONE, "readyReplicas": 0, "availableReplicas": 0})
    r = rollout_state(dep, "h1", [back_off(hash_="h1")])
    assert r.refused is not None and r.refused.message == VLLM_SAYS and r.template_hash == "h1"
    # the person fixed the spec: pods of the older template refusing are not this rollout's state
    assert rollout_state(dep, "h1", [back_off(hash_="h0")]).refused is None
    assert rollout_state(dep, "h1").refused is None


def test_a_crash_looping_refusal_is_said_as_the_refusal_with_vllms_words() -> None:
    p = back_off()
    p["spec"] = {"nodeName": "gpu-node-1", "containers": [{"name": "vllm"}]}
    v = pb.pod_verdict(p, now=T)
    assert v is not None and v.reason == "EngineRefusedArguments"
    msg = v.message(0)
    assert VLLM_SAYS in msg and "exit code 2" in msg and "spec.engine.extraArgs" in msg
    assert "CrashLoopBackOff" not in msg
    # no grace: vLLM's verdict on arguments no retry changes
    found = pb.pod_blockers([p], None, T)
    assert found.blocker is not None and found.blocker[0] == "EngineRefusedArguments"
    # ... and it is said before the Deployment's own deadline
    late = deployment(
        conditions=[{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]
    )
    found = pb.pod_blockers([p], None, T, deployment=late)
    assert found.blocker is not None and found.blocker[0] == "EngineRefusedArguments"


def test_vllms_words_are_bounded_and_folded() -> None:
    long = "ValidationError: 1 validation error for CompilationConfig\n  " + "x" * 2000
    record = tm.TerminationMessage(reason=tm.ENGINE_REFUSED, exit_code=2, detail=long).to_json()
    (t,) = terminations(back_off(record))
    said = pb.refusal(t).said
    assert "\n" not in said and len(said) < pb.REFUSAL_CHARS + 100 and said.endswith('\u2026"')
