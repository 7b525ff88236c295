"""Pure builders of pod status, following the rules the kubelet applies.

The process kubelet keeps one `ContainerView` per container; these functions turn views
into the `status` object a kubelet writes: the phase (kubelet's getPhase), the conditions
(PodReadyToStartContainers, Initialized, ContainersReady, Ready, with lastTransitionTime
kept while a condition does not change), and the container statuses with state, lastState
and restartCount. The termination-message rules are here too: the last 4096 bytes of the
container's terminationMessagePath file, or, under FallbackToLogsOnError after an error
exit with an empty file, the last 2048 bytes of the last 80 log lines.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_MESSAGE_BYTES = 4096  # kubelet: MaxContainerTerminationMessageLength
FALLBACK_LOG_LINES = 80  # kubelet: MaxContainerTerminationMessageLogLines
FALLBACK_LOG_BYTES = 2048  # kubelet: MaxContainerTerminationMessageLogLength

# Conditions the kubelet owns; anything else (PodScheduled, DisruptionTarget, readiness
# gates set by controllers) is kept as the API server has it.
KUBELET_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady")


def rfc3339(ts: float) -> str:
    """API time: whole seconds, UTC, 'Z' (metav1.Time drops fractions anyway)."""
    return datetime.datetime.fromtimestamp(int(ts), datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Termination:
    exit_code: int
    reason: str
    started_at: float
    finished_at: float
    message: str = ""
    container_id: str = ""
    signal: int = 0


@dataclass
class ContainerView:
    """One container as the kubelet sees it right now (mutated by its worker, read here)."""

    name: str
    image: str
    image_id: str = ""
    container_id: str = ""
    state: str = "waiting"  # waiting | running | terminated
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    started_at: float = 0.0
    terminated: Termination | None = None  # when state == "terminated"
    last_terminated: Termination | None = None
    # the run before last_terminated's: lastState again once a stop cancels a pending restart
    earlier_terminated: Termination | None = None
    restart_count: int = 0
    ready: bool = False
    started: bool = False


def _terminated_dict(t: Termination) -> dict[str, Any]:
    d: dict[str, Any] = {
        "exitCode": t.exit_code,
        "reason": t.reason,
        # A container that never started reads 1970-01-01T00:00:00Z, as with containerd.
        "startedAt": rfc3339(t.started_at),
        "finishedAt": rfc3339(t.finished_at),
    }
    if t.message:
        d["message"] = t.message
    if t.container_id:
        d["containerID"] = t.container_id
    if t.signal:
        d["signal"] = t.signal
    return d


def container_status(view: ContainerView) -> dict[str, Any]:
    if view.state == "running":
        state: dict[str, Any] = {"running": {"startedAt": rfc3339(view.started_at)}}
    elif view.state == "terminated" and view.terminated is not None:
        state = {"terminated": _terminated_dict(view.terminated)}
    else:
        waiting: dict[str, Any] = {"reason": view.waiting_reason}
        if view.waiting_message:
            waiting["message"] = view.waiting_message
        state = {"waiting": waiting}
    status: dict[str, Any] = {
        "name": view.name,
        "image": view.image,
        "imageID": view.image_id,
        "ready": view.ready,
        "restartCount": view.restart_count,
        "started": view.started,
        "state": state,
        "lastState": ({"terminated": _terminated_dict(view.last_terminated)} if view.last_terminated else {}),
    }
    if view.container_id:
        status["containerID"] = view.container_id
    return status


def _init_progress(init: Sequence[ContainerView]) -> tuple[int, int]:
    """(pending, failed) init containers, counted as the kubelet's getPhase does."""
    pending = failed = 0
    for v in init:
        if v.state == "running":
            pending += 1
        elif v.state == "terminated" and v.terminated is not None:
            if v.terminated.exit_code != 0:
                failed += 1
        elif v.last_terminated is not None and v.last_terminated.exit_code != 0:
            failed += 1
        else:
            pending += 1
    return pending, failed


def initialized(init: Sequence[ContainerView]) -> bool:
    return all(
        v.state == "terminated" and v.terminated is not None and v.terminated.exit_code == 0 for v in init
    )


def pod_phase(
    init: Sequence[ContainerView],
    containers: Sequence[ContainerView],
    restart_policy: str,
    terminal: bool = False,
) -> str:
    """The kubelet's getPhase. `terminal`: the pod is being torn down and will not restart."""
    pending_init, failed_init = _init_progress(init)
    if failed_init and (restart_policy == "Never" or terminal):
        return "Failed"
    running = waiting = stopped = succeeded = 0
    for v in containers:
        if v.state == "running":
            running += 1
        elif v.state == "terminated" and v.terminated is not None:
            stopped += 1
            succeeded += v.terminated.exit_code == 0
        elif v.last_terminated is not None:
            stopped += 1  # in back-off after a termination
        else:
            waiting += 1
    if pending_init or failed_init:
        return "Pending"
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if stopped:
        if restart_policy == "Always" and not terminal:
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        if restart_policy == "Never" or terminal:
            return "Failed"
        return "Running"
    return "Pending"


def pod_conditions(
    init: Sequence[ContainerView],
    containers: Sequence[ContainerView],
    *,
    phase: str,
    sandbox_ready: bool,
    now: float,
    previous: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, Any]]:
    """The kubelet's conditions, in its order, followed by the ones other writers own.

    lastTransitionTime is kept from `previous` while a condition's status does not change.
    """
    prev = {str(c.get("type")): c for c in previous}

    def condition(kind: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        status = "True" if ok else "False"
        old = prev.get(kind)
        since = old.get("lastTransitionTime") if old and old.get("status") == status else None
        cond: dict[str, Any] = {
            "type": kind,
            "status": status,
            "lastProbeTime": None,
            "lastTransitionTime": since or rfc3339(now),
        }
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        return cond

    done = phase in ("Succeeded", "Failed")
    incomplete = [v.name for v in init if not initialized([v])]
    unready = [v.name for v in containers if not v.ready]
    is_init = not incomplete
    conds = [condition("PodReadyToStartContainers", sandbox_ready and not done)]
    if done:
        conds.append(condition("Initialized", is_init, "PodCompleted"))
        conds.append(condition("Ready", False, "PodCompleted"))
        conds.append(condition("ContainersReady", False, "PodCompleted"))
    else:
        why = "" if is_init else "ContainersNotInitialized"
        msg = "" if is_init else f"containers with incomplete status: [{' '.join(incomplete)}]"
        conds.append(condition("Initialized", is_init, why, msg))
        ready = is_init and not unready
        why = "" if ready else "ContainersNotReady"
        msg = "" if ready else f"containers with unready status: [{' '.join(unready)}]"
        conds.append(condition("Ready", ready, why, msg))
        conds.append(condition("ContainersReady", ready, why, msg))
    conds.extend(dict(c) for c in previous if c.get("type") not in KUBELET_CONDITIONS)
    return conds


def pod_status(
    *,
    init: Sequence[ContainerView],
    containers: Sequence[ContainerView],
    restart_policy: str,
    pod_ip: str,
    host_ip: str,
    start_time: float,
    now: float,
    previous_conditions: Sequence[Mapping[str, Any]] = (),
    sandbox_ready: bool = True,
    terminal: bool = False,
) -> dict[str, Any]:
    phase = pod_phase(init, containers, restart_policy, terminal)
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": pod_conditions(
            init,
            containers,
            phase=phase,
            sandbox_ready=sandbox_ready,
            now=now,
            previous=previous_conditions,
        ),
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "startTime": rfc3339(start_time),
        "containerStatuses": [container_status(v) for v in containers],
    }
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if init:
        status["initContainerStatuses"] = [container_status(v) for v in init]
    return status


# ------------------------------------------------------------------------------ termination


def log_tail(log: bytes, lines: int = FALLBACK_LOG_LINES, max_bytes: int = FALLBACK_LOG_BYTES) -> str:
    """The last `lines` lines of a log, then the last `max_bytes` of those (kubelet's circbuf)."""
    body = log[:-1] if log.endswith(b"\n") else log
    kept = b"\n".join(body.split(b"\n")[-lines:]) + (b"\n" if log.endswith(b"\n") else b"")
    return kept[-max_bytes:].decode("utf-8", errors="replace")


def termination_message(message_file: bytes, policy: str, exit_code: int, log: bytes | None = None) -> str:
    """What the kubelet puts in `terminated.message`."""
    text = message_file[-MAX_MESSAGE_BYTES:].decode("utf-8", errors="replace")
    if not text and policy == "FallbackToLogsOnError" and exit_code != 0 and log:
        return log_tail(log)
    return text


def exit_reason(exit_code: int, oom_killed: bool) -> str:
    if oom_killed:
        return "OOMKilled"
    return "Completed" if exit_code == 0 else "Error"


def crash_loop_message(delay: float, container: str, pod: str, namespace: str, uid: str) -> str:
    """The kubelet's CrashLoopBackOff message (its back-off printed as a Go duration)."""
    seconds = f"{delay:g}s" if delay < 60 else f"{int(delay // 60)}m{delay % 60:g}s"
    return f"back-off {seconds} restarting failed container={container} pod={pod}_{namespace}({uid})"
