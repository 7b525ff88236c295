"""The image's own vLLM refused the arguments (issue 51), through the pure step in the in-memory
cluster: Degraded EngineRefusedArguments quoting vLLM, one Warning Event, no remediation, no
rollback and no roll however long the pods refuse (a passed progress deadline included), never
a crash loop; the person's fix rolls once, and the condition clears when the new pods serve."""

from __future__ import annotations

from typing import Any

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.effects import PostEvent
from rankguard_operator.core.step import Step
from tests.unit.reconcile_world import Cluster, pod, running

VLLM_SAYS = (
    "vllm serve: error: argument --runner: invalid choice: 'poolin' "
    "(choose from 'auto', 'draft', 'generate', 'pooling')"
)


def refused_record() -> dict[str, Any]:
    message = tm.TerminationMessage(reason=tm.ENGINE_REFUSED, exit_code=2, detail=VLLM_SAYS).to_json()
    return {"exitCode": 2, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}


def refusing(c: Cluster, run: int) -> None:
    """The Deployment's pod of its current template: run `run` refused, waiting in back-off."""
    assert c.deployment is not None
    annotations = c.deployment["spec"]["template"]["metadata"]["annotations"]
    p = pod(
        f"svc-{c.deployment['metadata']['generation']}", annotations, ready=False, terminated=refused_record()
    )
    p["spec"] = {"nodeName": "gpu-node-1"}
    p["status"]["containerStatuses"][0].update(
        restartCount=run + 1, state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s"}}
    )
    c.pods = [p]
    n = c.deployment["spec"]["replicas"]
    c.deployment["status"] = {
        "observedGeneration": c.deployment["metadata"]["generation"],
        "replicas": n,
        "updatedReplicas": n,
        "readyReplicas": 0,
        "availableReplicas": 0,
    }


def condition(c: Cluster, kind: str) -> dict[str, Any]:
    return next(x for x in c.status["conditions"] if x["type"] == kind)


def events(steps: list[Step], reason: str) -> list[PostEvent]:
    return [e for s in steps for e in s.effects if isinstance(e, PostEvent) and e.reason == reason]


def edit(c: Cluster, extra_args: list[str] | None) -> None:
    if extra_args is None:
        c.spec["engine"].pop("extraArgs", None)
    else:
        c.spec["engine"]["extraArgs"] = extra_args
    c.generation += 1


def test_a_refusal_is_degraded_once_and_nothing_rolls_until_the_person_fixes_it() -> None:
    c = running()
    edit(c, ["--runner", "pooling"])
    c.run()  # the person's edit: one roll
    applied = len(c.deployments_applied)
    steps: list[Step] = []
    for run in range(4):
        refusing(c, run)
        steps.append(c.run())
        steps.append(c.run())  # a pass between runs: the pod waits in back-off
        d = condition(c, "Degraded")
        assert (d["status"], d["reason"]) == ("True", "EngineRefusedArguments"), d
        assert VLLM_SAYS in d["message"] and "spec.engine.extraArgs" in d["message"]
        assert c.status["phase"] == "Degraded"
    # the Deployment passes its progress deadline: still the refusal, no rollback, no RolloutFailed
    assert c.deployment is not None
    c.deployment["status"]["conditions"] = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "timed out",
        }
    ]
    steps += [c.run(), c.run()]
    assert condition(c, "Degraded")["reason"] == "EngineRefusedArguments"
    # one Warning Event, however many runs were refused; never an engine error or a crash loop
    said = events(steps, "EngineRefusedArguments")
    assert len(said) == 1 and said[0].type == "Warning" and VLLM_SAYS in said[0].message
    for other in (
        "EngineError",
        "EngineCrashLoop",
        "RolloutFailed",
        "RolledBack",
        "ProgressDeadlineExceeded",
    ):
        assert events(steps, other) == [], other
    assert len(c.deployments_applied) == applied  # nothing rolled
    assert not c.status.get("remediations") and not c.status.get("pendingRemediation")
    assert condition(c, "Remediating")["status"] == "False"

    # the fix: exactly one roll; the condition stays while the new pod starts, and clears once it serves
    edit(c, None)
    c.run()
    assert len(c.deployments_applied) == applied + 1
    c.run()
    assert len(c.deployments_applied) == applied + 1
    assert condition(c, "Degraded")["reason"] == "EngineRefusedArguments"
    c.controller_done()
    c.run()
    assert condition(c, "Degraded")["status"] == "False"
    assert condition(c, "Ready")["status"] == "True" and c.status["phase"] == "Running"
    assert len(c.deployments_applied) == applied + 1
