"""`trust.trust`: which pods a pass listens to, and what it remembers between passes (a pod ahead
of its owner in the watch is not news yet; an ignored pod is said once while it exists; a pod's
termination counts only for runs that ended after the pod was first seen trusted)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from rankguard_operator.core.effects import ApplyDeployment, WriteIntent
from rankguard_operator.core.observe import ownership
from rankguard_operator.core.observe.pods import first_unended_run
from rankguard_operator.core.step import Memory, ReplicaSetRef, Step, reconcile, trust
from rankguard_operator.core.step.trust import UNVOUCHED_GRACE
from tests.builders import owned, owner_ref
from tests.unit.reconcile_world import SETTINGS, cuda_oom_record, running

SERVICE_UID = "svc-uid"


def _pass(pods: list[dict[str, object]], memory: Memory, now: float) -> tuple[list[str], list[str], Memory]:
    """(trusted pod names, reasons said this pass, the memory to hand on)."""
    got = trust(pods, {}, None, SERVICE_UID, statefulsets=[], memory=memory, now=now)
    names = [str(p["metadata"]["name"]) for p in got.pods]  # type: ignore[index]
    return names, [d.reason for d in got.newly_ignored], got.memory


def test_an_orphan_is_said_once_while_it_exists() -> None:
    orphan = owned("orphan", "u-1")
    trusted, said, memory = _pass([orphan], Memory(), now=0.0)
    assert trusted == [] and said == ["no-owner"]
    _, said, memory = _pass([orphan], memory, now=1.0)
    assert said == []  # said already
    _, said, memory = _pass([], memory, now=2.0)
    assert memory.said == frozenset()  # gone: forgotten
    _, said, _ = _pass([orphan], memory, now=3.0)
    assert said == ["no-owner"]  # back again: said again


def test_a_pod_ahead_of_its_owner_in_the_watch_is_news_only_after_the_grace() -> None:
    early = owned("svc-abcde", "u-2", owner_ref("ReplicaSet", "rs-unseen"))
    _, said, memory = _pass([early], Memory(), now=100.0)
    assert said == [] and "u-2" in memory.unvouched
    _, said, memory = _pass([early], memory, now=100.0 + UNVOUCHED_GRACE - 1)
    assert said == []
    _, said, memory = _pass([early], memory, now=100.0 + UNVOUCHED_GRACE)
    assert said == ["no-deployment"] and "u-2" not in memory.unvouched and "u-2" in memory.said


# ------------------------------------------------- a termination counts only once trusted
def _served(c: Any) -> tuple[dict[str, Any], dict[str, ReplicaSetRef]]:
    """The world's serving pod as the Deployment's ReplicaSet makes it (running), and that set."""
    c.deployment["metadata"].update(uid="dep-1", ownerReferences=[owner_ref("LLMService", "uid-1")])
    template = c.deployment["spec"]["template"]["spec"]
    p = copy.deepcopy(c.pods[0])
    p["metadata"].update(name="svc-6f7d9c4b8-x7k2q", ownerReferences=[owner_ref("ReplicaSet", "rs-1")])
    p["spec"] = copy.deepcopy(template)
    return p, {"rs-1": ReplicaSetRef("dep-1", "svc-6f7d9c4b8", ownership.template_fingerprint(template))}


def _ended(p: dict[str, Any], run: int) -> dict[str, Any]:
    """`p` after run `run` of its vllm container ended with a CUDA OOM record (restarting)."""
    out = copy.deepcopy(p)
    out["status"]["containerStatuses"] = [
        {
            "name": "vllm",
            "restartCount": run + 1,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": cuda_oom_record()},
        }
    ]
    out["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    return out


def _step(
    c: Any, pods: list[dict[str, Any]], owners: Any, memory: Memory, wall: float | None = None
) -> tuple[Step, Memory]:
    """One pass as the executor makes it: trust, then the step with what trust vouches for."""
    got = trust(pods, owners, c.deployment, "uid-1", statefulsets=[], memory=memory, now=0.0, wall=wall)
    world = replace(c.world(), pods=got.pods, counted_runs=got.counted_runs)
    return reconcile.step(c.state(), world, SETTINGS), got.memory


def _acted(step: Step) -> bool:
    return any(isinstance(e, (WriteIntent, ApplyDeployment)) for e in step.effects)


def test_a_termination_counts_only_from_a_pod_trusted_before_the_run_ended() -> None:
    """Issue 50: an orphan wrote the agent's OOM record, then was patched to name the real
    ReplicaSet; with a spec that passes provenance (a copy of the template) it is trusted, but
    its record was written before: not acted upon. The real pod's record, from a run that ended
    after the pod was trusted, is (so the test can fail)."""
    c = running()
    kv_before = c.status["servingFlags"]
    real, owners = _served(c)
    forged = copy.deepcopy(real)
    forged["metadata"].update(name="svc-6f7d9c4b8-fgd22", uid="uid-forged")
    # the forged pod, first seen (trusted) with its record already written
    step, memory = _step(c, [_ended(forged, 0)], owners, Memory())
    assert memory.counted_from == {"uid-forged": 1}
    assert not _acted(step) and step.state.raw.get("servingFlags") == kv_before
    step, memory = _step(c, [_ended(forged, 0)], owners, memory)  # and on later passes
    assert not _acted(step)
    # the real pod, trusted while its run 0 went on, then that run's end
    _, memory = _step(c, [real], owners, Memory())
    assert memory.counted_from == {real["metadata"]["uid"]: 0}
    step, _ = _step(c, [_ended(real, 0)], owners, memory)
    assert _acted(step)


def test_after_a_restart_a_crash_looping_pods_record_counts_a_finished_ones_does_not() -> None:
    """Trust's memory is the operator's: a restarted operator cannot know whether a pod made
    before its first pass was its owner's when its run ended. A pod that runs on as its owner's
    (crash-looping, the OOM in lastState) counts: a restart between an OOM and its remediation
    must not lose it (the OOM may not come again). One that is being deleted or Failed, as the
    forged pod lingers, does not. A pod made after the first pass is held to the strict rule."""
    c = running()
    real, owners = _served(c)
    real["metadata"]["creationTimestamp"] = "2027-01-15T08:00:00Z"
    first_pass = 1_800_000_000.0  # 2027-01-15T08:00:00Z: made no later than the first pass
    step, memory = _step(c, [_ended(real, 0)], owners, Memory(), wall=first_pass)
    assert memory.since == first_pass and memory.counted_from == {real["metadata"]["uid"]: 0}
    assert _acted(step)
    held = _ended(real, 0)
    held["metadata"]["deletionTimestamp"] = "2027-01-15T08:01:00Z"
    step, memory = _step(c, [held], owners, Memory(), wall=first_pass)
    assert not _acted(step) and memory.counted_from == {real["metadata"]["uid"]: 1}
    failed = _ended(real, 0)
    failed["status"]["phase"] = "Failed"
    assert not _acted(_step(c, [failed], owners, Memory(), wall=first_pass)[0])
    # made after this operator's first pass: seen from its start, so an ended run it was not
    # trusted for does not count
    late = _ended(real, 0)
    late["metadata"]["creationTimestamp"] = "2027-01-15T08:00:00Z"
    step, memory = _step(c, [late], owners, Memory(since=first_pass - 3600 * 24 * 365 * 3))
    assert not _acted(step) and memory.counted_from == {real["metadata"]["uid"]: 1}
    # the next run's end counts; a pod that is gone is forgotten
    assert _acted(_step(c, [_ended(real, 1)], owners, memory)[0])
    _, memory = _step(c, [], owners, memory)
    assert memory.counted_from == {}


def test_first_unended_run_reads_the_containers_state() -> None:
    p: dict[str, Any] = {"status": {}}
    assert first_unended_run(p) == 0  # not started: every run counts
    p["status"]["containerStatuses"] = [{"name": "vllm", "restartCount": 2, "state": {"running": {}}}]
    assert first_unended_run(p) == 2
    p["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 1}}
    assert first_unended_run(p) == 3  # run 2 ended already
    p["status"]["containerStatuses"][0]["name"] = "sidecar"
    assert first_unended_run(p) == 0
