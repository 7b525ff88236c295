"""Why a service's pods do not start when the scheduler is not the reason (that one is
`observe.blockers`): each cause Kubernetes reports, as a class with its own Degraded reason,
Kubernetes' own words (bounded, whitespace folded), the object named, and what to change.
(Over 450 lines because every cause is read against one table, its reason, grace and hint, and
one verdict orders them: split, the table and the readers would drift apart.)

=======================  ==============================================================  =====
Degraded reason          what Kubernetes shows                                           grace
=======================  ==============================================================  =====
PodCreateFailed          the Deployment's ReplicaFailure condition (FailedCreate: the    10 s
                         API server refused the pods: a priorityClassName,
                         serviceAccountName or runtimeClassName that does not exist, a
                         quota); a StatefulSet's FailedCreate Warning Event
PodConfigError           a container waiting in CreateContainerConfigError,              15 s
                         CreateContainerError or RunContainerError (env from a missing
                         Secret or ConfigMap, a missing key)
ImagePullFailed          ErrImagePull, ImagePullBackOff, InvalidImageName, ...           30 s
VolumeMountFailed        a pod still in ContainerCreating whose kubelet posted a         0 s
                         FailedMount Warning Event (the real kubelet says so only in
                         the Event; the Events are read after MOUNT_WAIT_SECONDS)
InitContainerFailed      an init container that ended non-zero or is in                  10 s
                         CrashLoopBackOff (the agent installer's normal run is not)
NoScheduler              a Pending pod no scheduler has answered (no PodScheduled        30 s
                         condition at all): spec.schedulerName nobody serves
EngineRefusedArguments   the vLLM container's latest run ended with the agent's          0 s
                         termination record EngineRefusedArguments (the image's own
                         vLLM refused the arguments before the engine started) and has
                         not run since: said as the refusal, with vLLM's words, never
                         as a crash loop
SidecarNotReady          a container other than vLLM running but never Ready, or         30 s+
                         crash-looping (vLLM may load weights for many minutes: its
                         readiness and its crashes are the policy's business)
ProgressDeadlineExceeded the Deployment's Progressing condition False                    0 s
=======================  ==============================================================  =====

A grace is how long something must have blocked (`status.stuckSince`, this module's clock,
kept across passes and restarts like `unschedulableSince`) before its class is said: each
covers the retry Kubernetes makes on its own (a Secret created a moment after the pod, an
image registry's hiccup). A sidecar's grace also covers its own probe's initial delay and
failure threshold. GPU memory (CUDA OOM, OOMKilled, engine crashes of vLLM) stays the
policy's (core/policy/crash_rules): of the vLLM container's terminations only a refusal of its
arguments is read here (the policy says it too; this keeps it said between the runs the
kubelet's back-off spaces out, and for a multi-node service, which has no rollout to read).
A refusal is vLLM's own verdict on arguments that do not change between runs: no grace.

Pure: no I/O, no clock (`now` is an argument). Events come in already read (the edge reads
the Warning Events of the objects `event_subjects` names, and only those).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.names import VLLM_CONTAINER
from rankguard_operator.core.observe.blockers import bounded
from rankguard_operator.core.observe.pods import ENGINE_REFUSED, Termination, get_path, refused_run
from rankguard_operator.core.units import parse_iso

# the Degraded reasons, in the order a pass says them when several hold at once (the earliest
# cause first: pods that cannot be created, then containers that cannot be made, then ...)
POD_CREATE_FAILED = "PodCreateFailed"
POD_CONFIG_ERROR = "PodConfigError"
IMAGE_PULL_FAILED = "ImagePullFailed"
VOLUME_MOUNT_FAILED = "VolumeMountFailed"
INIT_CONTAINER_FAILED = "InitContainerFailed"
NO_SCHEDULER = "NoScheduler"
ENGINE_REFUSED_ARGUMENTS: str = ENGINE_REFUSED
SIDECAR_NOT_READY = "SidecarNotReady"
PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
REASONS = (
    POD_CREATE_FAILED,
    POD_CONFIG_ERROR,
    IMAGE_PULL_FAILED,
    VOLUME_MOUNT_FAILED,
    INIT_CONTAINER_FAILED,
    NO_SCHEDULER,
    ENGINE_REFUSED_ARGUMENTS,
    SIDECAR_NOT_READY,
    PROGRESS_DEADLINE_EXCEEDED,
)

# Seconds a class must have blocked before it is said. The kubelet retries a container's
# config on every sync (~10 s) and an image pull with back-off; the ReplicaSet controller
# retries a refused create within seconds; the scheduler answers a pod in milliseconds.
GRACE_SECONDS: Mapping[str, float] = {
    POD_CREATE_FAILED: 10.0,
    POD_CONFIG_ERROR: 15.0,
    IMAGE_PULL_FAILED: 30.0,
    VOLUME_MOUNT_FAILED: 0.0,  # the Events are read only after MOUNT_WAIT_SECONDS already
    INIT_CONTAINER_FAILED: 10.0,
    NO_SCHEDULER: 30.0,
    ENGINE_REFUSED_ARGUMENTS: 0.0,  # vLLM's own verdict on arguments no retry changes
    SIDECAR_NOT_READY: 30.0,
    PROGRESS_DEADLINE_EXCEEDED: 0.0,  # the Deployment's own deadline has passed
}
# A pod on a node none of whose containers has run yet is asked about (its Warning Events read)
# after this long: the kubelet mounts a pod's volumes within a second or two when it can.
MOUNT_WAIT_SECONDS = 10.0
# A Warning Event older than this no longer speaks for the object (Events live an hour; a
# controller's back-off retries within minutes and refreshes lastTimestamp each time).
EVENT_FRESH_SECONDS = 600.0

CONFIG_WAITING = frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"})
IMAGE_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "RegistryUnavailable",
        "SignatureValidationFailed",
    }
)
MOUNT_EVENTS = frozenset({"FailedMount", "FailedAttachVolume", "FailedMapVolume"})
# Where a pod compacted by the edge's index keeps its containers' names, readinessProbes and
# restartPolicies (edge/handlers), read when the pod carries no spec.containers.
CONTAINERS_KEY = "rankguard.io/containers"
# kubelet defaults of a probe (k8s.io/api core/v1: periodSeconds 10, failureThreshold 3)
PROBE_PERIOD_SECONDS, PROBE_FAILURES = 10.0, 3

HINTS: Mapping[str, str] = {
    POD_CREATE_FAILED: (
        "the API server refuses the pods: create what the message names (a PriorityClass, "
        "ServiceAccount or RuntimeClass) or fix spec.template's priorityClassName, "
        "serviceAccountName or runtimeClassName (or the quota or admission policy that refuses them)"
    ),
    POD_CONFIG_ERROR: (
        "create the Secret or ConfigMap the message names (or the key in it) in the service's "
        "namespace, or fix the env, envFrom or volumeMounts in spec.template"
    ),
    IMAGE_PULL_FAILED: (
        "check the image name (spec.image, spec.agent.image, spec.template's containers), that "
        "the registry is reachable from the node, and spec.template's imagePullSecrets"
    ),
    VOLUME_MOUNT_FAILED: (
        "create the ConfigMap, Secret or claim the volume names in the service's namespace, or "
        "fix spec.template's volumes"
    ),
    INIT_CONTAINER_FAILED: (
        "read its log (kubectl logs POD -c CONTAINER --previous) and fix the init container in "
        "spec.template (for rankguard-agent-install: spec.agent.image)"
    ),
    NO_SCHEDULER: "run that scheduler, or remove schedulerName from spec.template",
    ENGINE_REFUSED_ARGUMENTS: (
        "no GPU memory was used, and every start is refused the same way, so rankguard "
        "remediates nothing and rolls nothing back: change what vLLM names (spec.engine.extraArgs, "
        "or the spec field that renders that flag) and apply the spec (one roll)"
    ),
    SIDECAR_NOT_READY: (
        "a pod is Ready only when every container is, so the Service sends it no traffic: fix the "
        "sidecar or its readinessProbe in spec.template (kubectl describe pod, kubectl logs -c)"
    ),
    PROGRESS_DEADLINE_EXCEEDED: "see the pods' events and logs (kubectl describe pod)",
}


@dataclass(frozen=True)
class Stuck:
    """One object that does not progress, as Kubernetes says it."""

    reason: str  # the Degraded reason (REASONS)
    subject: str  # the object named: "pod svc-abc, container vllm"
    said: str  # Kubernetes' own reason and message
    grace: float  # seconds it must have blocked before it is said
    name: str = ""  # the object's name, to order the verdicts

    def message(self, others: int) -> str:
        more = f" ({others} more object(s) of the service are stuck too)" if others else ""
        return f"{self.subject}: {self.said}{more}. {HINTS[self.reason]}"


def _stuck(reason: str, subject: str, said: str, name: str) -> Stuck:
    return Stuck(reason, subject, said, GRACE_SECONDS[reason], name)


# vLLM's own words quoted in a condition: an argparse line or an exception with its text (a
# pydantic validation error lists every field it refused); the termination record keeps 1 KiB
REFUSAL_CHARS = 600


def refusal(t: Termination) -> Stuck:
    """A run the image's own vLLM refused, as a blocker (and as the policy says it: one text)."""
    code = "" if t.exit_code is None else f" (exit code {t.exit_code})"
    words = bounded(t.message, REFUSAL_CHARS) or "no message was recorded"
    said = f'vLLM refused its arguments before the engine started{code}: "{words}"'
    return _stuck(ENGINE_REFUSED_ARGUMENTS, f"pod {t.pod_name}, container {t.container}", said, t.pod_name)


@dataclass(frozen=True)
class PodBlockers:
    since: float | None  # status.stuckSince for the next pass (None: nothing is stuck)
    blocker: tuple[str, str] | None  # (reason, message) once one is due; None before
    due_in: float | None = None  # seconds until the next verdict falls due (a pass is needed then)


# --------------------------------------------------------------------------------------------
# Reading the objects


def _said(reason: str, message: Any) -> str:
    text = bounded(str(message or "")) if message else ""
    return f'{reason}: "{text}"' if text else reason


def _terminated_text(t: Mapping[str, Any]) -> str:
    code = t.get("exitCode")
    reason = str(t.get("reason") or "Error")
    text = f"{reason}, exit code {code}"
    msg = t.get("message")
    return f"{text}: {bounded(str(msg))}" if msg else text


def _events(
    events: Sequence[Mapping[str, Any]], reasons: frozenset[str], now: float
) -> Mapping[str, Any] | None:
    """The newest fresh Warning Event of `reasons`."""
    best: tuple[float, Mapping[str, Any]] | None = None
    for e in events:
        if e.get("type") != "Warning" or e.get("reason") not in reasons:
            continue
        when = parse_iso(
            e.get("lastTimestamp") or e.get("eventTime") or get_path(e, "series", "lastObservedTime")
        )
        when = parse_iso(e.get("firstTimestamp")) if when is None else when
        if when is not None and now - when > EVENT_FRESH_SECONDS:
            continue
        key = when if when is not None else 0.0
        if best is None or key >= best[0]:
            best = (key, e)
    return None if best is None else best[1]


def _nothing_ran(pod: Mapping[str, Any]) -> bool:
    statuses = [
        *(get_path(pod, "status", "initContainerStatuses") or []),
        *(get_path(pod, "status", "containerStatuses") or []),
    ]
    for cs in statuses:
        state = cs.get("state") or {}
        if "running" in state or "terminated" in state or (cs.get("lastState") or {}):
            return False
    return True


def _age(pod: Mapping[str, Any], now: float) -> float | None:
    started = parse_iso(
        get_path(pod, "status", "startTime") or get_path(pod, "metadata", "creationTimestamp")
    )
    return None if started is None else now - started


def event_subjects(
    pods: Sequence[Mapping[str, Any]], statefulsets: Sequence[Mapping[str, Any]], now: float
) -> list[str]:
    """The uids whose Warning Events a pass needs: pods on a node none of whose containers has
    run for MOUNT_WAIT_SECONDS (a volume the kubelet cannot mount says so only in an Event),
    and StatefulSets with fewer pods than they want (a refused create is only an Event there)."""
    out = []
    for p in pods:
        if get_path(p, "metadata", "deletionTimestamp") or not get_path(p, "spec", "nodeName"):
            continue
        age = _age(p, now)
        waiting = get_path(p, "status", "phase") in (None, "Pending") and _nothing_ran(p)
        if waiting and age is not None and age >= MOUNT_WAIT_SECONDS:
            out.append(str(get_path(p, "metadata", "uid") or ""))
    for s in statefulsets:
        want = get_path(s, "spec", "replicas")
        have = get_path(s, "status", "replicas") or 0
        if isinstance(want, int) and have < want:
            out.append(str(get_path(s, "metadata", "uid") or ""))
    return [u for u in out if u]


def _readiness_grace(container: Mapping[str, Any]) -> float:
    probe = container.get("readinessProbe") or {}
    delay = float(probe.get("initialDelaySeconds") or 0)
    period = float(probe.get("periodSeconds") or PROBE_PERIOD_SECONDS)
    failures = int(probe.get("failureThreshold") or PROBE_FAILURES)
    return max(GRACE_SECONDS[SIDECAR_NOT_READY], delay + period * failures)


def _container_specs(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """name -> the container's spec: the pod's own, or what the edge's pod index keeps of it
    (CONTAINERS_KEY: names, readiness probes, restart policies; the index keeps no spec)."""
    spec = pod.get("spec") or {}
    kept = pod.get(CONTAINERS_KEY) or []
    every = [*(spec.get("initContainers") or []), *(spec.get("containers") or []), *kept]
    return {str(c.get("name")): c for c in every if isinstance(c, Mapping)}


def _waiting_verdict(waiting: Mapping[str, Any], subject: str, name: str) -> Stuck | None:
    """A container that cannot be made: its config (a missing Secret, ConfigMap or key) or its image."""
    reason = str(waiting.get("reason") or "")
    if reason in CONFIG_WAITING:
        return _stuck(POD_CONFIG_ERROR, subject, _said(reason, waiting.get("message")), name)
    if reason in IMAGE_WAITING:
        return _stuck(IMAGE_PULL_FAILED, subject, _said(reason, waiting.get("message")), name)
    return None


def _init_verdict(pod: Mapping[str, Any], name: str) -> Stuck | None:
    """The first init container that blocks the pod, in the order the kubelet runs them."""
    specs = _container_specs(pod)
    for cs in get_path(pod, "status", "initContainerStatuses") or []:
        stuck = _one_init_verdict(pod, name, cs, specs.get(str(cs.get("name") or "")) or {})
        if stuck is not None:
            return stuck
    return None


def _one_init_verdict(
    pod: Mapping[str, Any], name: str, cs: Mapping[str, Any], spec: Mapping[str, Any]
) -> Stuck | None:
    c = str(cs.get("name") or "")
    subject = f"pod {name}, init container {c}"
    state = cs.get("state") or {}
    waiting = state.get("waiting") or {}
    stuck = _waiting_verdict(waiting, subject, name)
    if stuck is not None:
        return stuck
    if (state.get("terminated") or {}).get("exitCode") == 0:
        return None  # done (the agent installer's every start; or a retry that succeeded)
    if spec.get("restartPolicy") == "Always":  # a native sidecar: it runs beside the containers
        crashing = waiting.get("reason") == "CrashLoopBackOff"
        if crashing or ("running" in state and cs.get("ready") is not True):
            return _sidecar(pod, name, cs, spec, init=True)
        return None
    return _init_failed(cs, subject, name)


def _init_failed(cs: Mapping[str, Any], subject: str, name: str) -> Stuck | None:
    """An init container that ended non-zero or crash-loops; None while it runs its first run.
    (A failed one that runs again is still failing: its runs last a second, its back-offs a
    few, and a verdict that flickered with them would never outlast its grace.)"""
    state = cs.get("state") or {}
    waiting = state.get("waiting") or {}
    reason = str(waiting.get("reason") or "")
    ended = state.get("terminated") or {}
    last = (cs.get("lastState") or {}).get("terminated") or {}
    failed = ended if ended.get("exitCode") is not None else last if last.get("exitCode") else {}
    if reason != "CrashLoopBackOff" and not failed:
        return None
    said = f"{_terminated_text(failed)}" if failed else _said(reason, waiting.get("message"))
    if reason == "CrashLoopBackOff" and failed:
        said = f"CrashLoopBackOff, last run: {said}"
    return _stuck(INIT_CONTAINER_FAILED, subject, said, name)


def _sidecar(
    pod: Mapping[str, Any], name: str, cs: Mapping[str, Any], spec: Mapping[str, Any], *, init: bool = False
) -> Stuck:
    c = str(cs.get("name") or "")
    kind = "sidecar (init) container" if init else "container"
    waiting = (cs.get("state") or {}).get("waiting") or {}
    last = (cs.get("lastState") or {}).get("terminated") or {}
    if waiting.get("reason") == "CrashLoopBackOff":
        said = "CrashLoopBackOff" + (f", last run: {_terminated_text(last)}" if last else "")
        return _stuck(SIDECAR_NOT_READY, f"pod {name}, {kind} {c}", said, name)
    ready: Mapping[str, Any] = next(
        (
            x
            for x in get_path(pod, "status", "conditions") or []
            if isinstance(x, Mapping) and x.get("type") == "ContainersReady"
        ),
        {},
    )
    said = _said("not Ready", ready.get("message") or f"containers with unready status: [{c}]")
    return Stuck(SIDECAR_NOT_READY, f"pod {name}, {kind} {c}", said, _readiness_grace(spec), name)


def pod_verdict(
    pod: Mapping[str, Any], events: Sequence[Mapping[str, Any]] = (), now: float = 0.0
) -> Stuck | None:
    """Why `pod` does not start, as Kubernetes says it; None when it is not stuck (or only the
    scheduler or the policy has something to say about it). `events`: its Warning Events, when
    the edge read them (event_subjects)."""
    if get_path(pod, "metadata", "deletionTimestamp"):
        return None
    name = str(get_path(pod, "metadata", "name") or "")
    if get_path(pod, "status", "phase") in ("Succeeded", "Failed"):
        return None
    if not get_path(pod, "spec", "nodeName"):
        return _unscheduled_verdict(pod, name)
    # the first cause in the order a pod starts: init containers, containers made, volumes, sidecars
    refused = refused_run(pod)
    return (
        _init_verdict(pod, name)
        or _containers_waiting_verdict(pod, name)
        or (None if refused is None else refusal(refused))
        or _mount_verdict(pod, name, events, now)
        or _sidecars_verdict(pod, name)
    )


def _unscheduled_verdict(pod: Mapping[str, Any], name: str) -> Stuck | None:
    """A pod on no node: NoScheduler when no scheduler has answered it at all."""
    conditions = get_path(pod, "status", "conditions") or []
    answered = any(c.get("type") == "PodScheduled" for c in conditions if isinstance(c, Mapping))
    # (a pod with container statuses has been on a node, whatever the copy at hand omits)
    if not answered and not get_path(pod, "status", "containerStatuses"):
        scheduler = str(get_path(pod, "spec", "schedulerName") or "default-scheduler")
        said = f'no scheduler has answered: spec.schedulerName "{bounded(scheduler, 253)}" is served by none'
        return _stuck(NO_SCHEDULER, f"pod {name}", said, name)
    return None  # PodScheduled False is the scheduler's own verdict (observe.blockers)


def _containers_waiting_verdict(pod: Mapping[str, Any], name: str) -> Stuck | None:
    for cs in get_path(pod, "status", "containerStatuses") or []:
        c = str(cs.get("name") or "")
        waiting = (cs.get("state") or {}).get("waiting") or {}
        stuck = _waiting_verdict(waiting, f"pod {name}, container {c}", name)
        if stuck is not None:
            return stuck
    return None


def _mount_verdict(
    pod: Mapping[str, Any], name: str, events: Sequence[Mapping[str, Any]], now: float
) -> Stuck | None:
    """A volume the kubelet cannot mount: it says so only in an Event, while nothing has run."""
    mount = _events(events, MOUNT_EVENTS, now) if _nothing_ran(pod) else None
    if mount is None:
        return None
    count = mount.get("count")
    times = f" ({count} times)" if isinstance(count, int) and count > 1 else ""
    said = _said(str(mount.get("reason")), mount.get("message")) + times
    return _stuck(VOLUME_MOUNT_FAILED, f"pod {name}", said, name)


def _sidecars_verdict(pod: Mapping[str, Any], name: str) -> Stuck | None:
    specs = _container_specs(pod)
    for cs in get_path(pod, "status", "containerStatuses") or []:
        c = str(cs.get("name") or "")
        if c == VLLM_CONTAINER:
            continue  # vLLM's readiness may take many minutes; its crashes are the policy's
        state = cs.get("state") or {}
        crash = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff"
        unready = "running" in state and cs.get("ready") is not True and cs.get("started") is not False
        if crash or unready:
            return _sidecar(pod, name, cs, specs.get(c) or {})
    return None


def deployment_verdict(deployment: Mapping[str, Any] | None) -> Stuck | None:
    """The Deployment's own word: ReplicaFailure (FailedCreate, copied from its ReplicaSet) or
    Progressing False (ProgressDeadlineExceeded)."""
    if deployment is None:
        return None
    name = str(get_path(deployment, "metadata", "name") or "")
    conds = [c for c in get_path(deployment, "status", "conditions") or [] if isinstance(c, Mapping)]
    for c in conds:
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            said = _said(str(c.get("reason") or "FailedCreate"), c.get("message"))
            return _stuck(POD_CREATE_FAILED, f"Deployment {name}", said, name)
    observed = get_path(deployment, "status", "observedGeneration")
    current = observed is not None and observed == get_path(deployment, "metadata", "generation")
    for c in conds:
        # (before the controller has seen the latest spec, the condition speaks of an older one)
        if current and c.get("type") == "Progressing" and c.get("status") == "False":
            said = _said(str(c.get("reason") or "ProgressDeadlineExceeded"), c.get("message"))
            return _stuck(PROGRESS_DEADLINE_EXCEEDED, f"Deployment {name}", said, name)
    return None


def statefulset_verdict(
    s: Mapping[str, Any], events: Sequence[Mapping[str, Any]], now: float
) -> Stuck | None:
    """A StatefulSet that cannot create its pods says so only in a FailedCreate Warning Event."""
    want = get_path(s, "spec", "replicas")
    if not isinstance(want, int) or (get_path(s, "status", "replicas") or 0) >= want:
        return None
    e = _events(events, frozenset({"FailedCreate"}), now)
    if e is None:
        return None
    name = str(get_path(s, "metadata", "name") or "")
    return _stuck(POD_CREATE_FAILED, f"StatefulSet {name}", _said("FailedCreate", e.get("message")), name)


# --------------------------------------------------------------------------------------------
# The verdict


def pod_blockers(
    pods: Sequence[Mapping[str, Any]],
    since: float | None,
    now: float,
    *,
    deployment: Mapping[str, Any] | None = None,
    statefulsets: Sequence[Mapping[str, Any]] = (),
    events: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> PodBlockers:
    """Track what keeps the service's pods from starting; a blocker once one class has blocked
    for its grace. `events`: the Warning Events the edge read, by involved object uid."""
    ev = events or {}
    found = [
        v
        for p in pods
        if (v := pod_verdict(p, ev.get(str(get_path(p, "metadata", "uid") or "")) or (), now)) is not None
    ]
    found += [
        v
        for s in statefulsets
        if (v := statefulset_verdict(s, ev.get(str(get_path(s, "metadata", "uid") or "")) or (), now))
        is not None
    ]
    d = deployment_verdict(deployment)
    if d is not None:
        found.append(d)
    if not found:
        return PodBlockers(None, None)
    start = now if since is None or since > now else since
    waited = now - start
    due = sorted((v for v in found if waited >= v.grace), key=lambda v: (REASONS.index(v.reason), v.name))
    if not due:
        return PodBlockers(start, None, min(v.grace for v in found) - waited)
    first = due[0]
    return PodBlockers(start, (first.reason, first.message(len(found) - 1)))
