"""Pure extraction from API objects: container terminations, pod readiness, rollout progress.

Input is what the API server returns (camelCase dicts, as kopf hands them over); output is
small frozen dataclasses the policy reads.

How a termination is identified: the kubelet reports the run that just ended first in
`state.terminated` (restartCount N) and, once the container restarted, in
`lastState.terminated` (restartCount N+1). Both describe run N, so `Termination.restart_count`
is that run's number and `key` (pod uid / container / run) is the same in both views: a
termination delivered twice, or seen in both places, is handled once.

(Over 450 lines because a run's termination, a pod's refused run and the rollout are read from
the same container statuses with the same keys: split, the three readings would drift apart.)

Pure: no I/O, no clock.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, TypedDict

from rankguard_agent.wire import termination as tm
from rankguard_agent.wire.recognisers import AVAILABLE_KV, CudaOom, KVObservation, KVTooSmall, recognise
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.names import (
    FLAGS_ANNOTATION,
    GROUP_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    VLLM_CONTAINER,
)
from rankguard_operator.core.units import parse_iso

TerminationKind = Literal[
    "CUDAOutOfMemory", "KVCacheTooSmall", "OOMKilled", "EngineError", "EngineRefusedArguments", "Other"
]
CUDA_OOM: TerminationKind = "CUDAOutOfMemory"
KV_CACHE_TOO_SMALL: TerminationKind = "KVCacheTooSmall"
OOM_KILLED: TerminationKind = "OOMKilled"
ENGINE_ERROR: TerminationKind = "EngineError"
# The image's own vLLM refused the arguments before the engine started (the agent's engine
# judge): nothing ran, no GPU memory was touched, and the same arguments are refused on every
# run, so no flag rankguard moves and no rollback can fix it; a person must change the spec.
ENGINE_REFUSED: TerminationKind = "EngineRefusedArguments"
OTHER: TerminationKind = "Other"
# A run that failed, for memory (the GPU's, the KV cache's, the container's) or in the engine:
# what the flags it ran under can be blamed for. `Other` is a stop (a rollout, a scale-down).
# A refusal is not one of them: the arguments the person wrote are refused, not the flags.
FAILURE_KINDS: tuple[TerminationKind, ...] = (CUDA_OOM, KV_CACHE_TOO_SMALL, OOM_KILLED, ENGINE_ERROR)

# Exit codes of a process stopped by SIGINT/SIGTERM (128 + signal): a normal rollout or
# scale-down stopping the pod, never an engine failure.
_STOP_EXIT_CODES = (130, 143)
# 128 + SIGKILL: the container's main process (the launcher) was killed by something outside the
# engine: a person, a node agent, the kubelet after a probe's grace period. The kernel's OOM
# killer is the kubelet's own reason, OOMKilled, and is told apart there. A killed launcher writes
# no termination message, so the log tail the kubelet keeps is its last line, never the cause.
SIGKILL_EXIT_CODE = 137
SIGKILLED = f"killed by SIGKILL (exit {SIGKILL_EXIT_CODE})"
_MAX_MESSAGE = 1024


# --------------------------------------------------------------------------------------------
# Pods


def get_path(doc: Any, *path: str) -> Any:
    """doc[path[0]][path[1]]..., or None where a step is missing or not a mapping."""
    for key in path:
        if not isinstance(doc, Mapping):
            return None
        doc = doc.get(key)
    return doc


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition is True (and it is not being deleted)."""
    if get_path(pod, "metadata", "deletionTimestamp"):
        return False
    for c in get_path(pod, "status", "conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def pod_ip(pod: Mapping[str, Any]) -> str | None:
    ip = get_path(pod, "status", "podIP")
    return ip if isinstance(ip, str) and ip else None


def carried_template_hash(obj: Mapping[str, Any] | None) -> str | None:
    """The rankguard template hash a pod (or a pod template) carries in its annotations: the
    template the pod was created from. None for anything rankguard did not render."""
    v = get_path(obj, "metadata", "annotations", TEMPLATE_HASH_ANNOTATION)
    return v if isinstance(v, str) and v else None


def deployment_template_hash(deployment: Mapping[str, Any] | None) -> str | None:
    """The template hash of the pod template a Deployment holds now (None: none, or not ours)."""
    return carried_template_hash(get_path(deployment, "spec", "template"))


def pod_flags(pod: Mapping[str, Any]) -> ServingFlags | None:
    """The serving flags the pod was rendered with, from its annotation."""
    raw = get_path(pod, "metadata", "annotations", FLAGS_ANNOTATION)
    if not isinstance(raw, str):
        return None
    try:
        return ServingFlags.from_status(json.loads(raw))
    except (json.JSONDecodeError, RecursionError):
        return None


# --------------------------------------------------------------------------------------------
# Terminations


@dataclass(frozen=True)
class Termination:
    """One ended run of the vLLM container, with whatever the termination message told."""

    pod_name: str
    pod_uid: str
    container: str
    restart_count: int  # the number of the run that ended (0 = first run)
    kind: TerminationKind
    exit_code: int | None
    rank: int | None = None
    requested_bytes: int | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    finished_at: float | None = None  # epoch seconds; None if the kubelet gave no time
    message: str = ""
    reason: str = ""  # the kubelet's reason (OOMKilled, Error, Completed, ...)
    kv_cache_bytes: int | None = None  # vLLM's "Available KV cache memory" in the run, if printed
    flags: ServingFlags | None = None  # what the pod ran with (its rankguard annotation)
    startup_refusal: bool = False  # vLLM's start-up check: free at start < utilisation × total
    # a start-up refusal because the weights another process holds on the GPU (a zero-copy
    # weight cache) reach utilisation × total: these bytes; None for every other termination
    external_weight_bytes: int | None = None
    # the engine phase the rank ran out of memory in (the termination message's, one of the
    # agent's termination.PHASES); None: unknown (a log tail, an older agent, no OOM)
    phase: str | None = None
    # a CUDA OOM's rank: free memory and other processes' memory when its worker began loading
    # weights in that run (vLLM 0.34's init snapshot, as the agent saw it); None: not seen
    free_at_load_bytes: int | None = None
    others_at_load_bytes: int | None = None
    others_peak_bytes: int | None = None  # the most others held on its GPU, as its agent saw
    template_hash: str | None = None  # the rankguard pod template the pod was created from

    @property
    def sigkilled(self) -> bool:
        """The launcher was killed by SIGKILL, not by the kernel's OOM killer (OOMKilled)."""
        return (
            self.kind == ENGINE_ERROR and self.exit_code == SIGKILL_EXIT_CODE and self.reason != "OOMKilled"
        )

    @property
    def key(self) -> str:
        """Dedup key: the same run seen twice (or in state and lastState) has the same key."""
        return f"{self.pod_uid}/{self.container}/{self.restart_count}"

    @property
    def deficit_bytes(self) -> int | None:
        """Bytes the failing allocation lacked (requested − free), when both were reported."""
        if self.requested_bytes is None or self.free_bytes is None:
            return None
        return max(0, self.requested_bytes - self.free_bytes)


def kv_bytes_from_line(line: str | None) -> int | None:
    """The bytes of a termination's `last_kv_line` when it is vLLM's "Available KV cache memory"."""
    if not line:
        return None
    seen = recognise(line)
    if isinstance(seen, KVObservation) and seen.kind == AVAILABLE_KV:
        return int(seen.value)
    return None


def _from_log_tail(text: str, reason: str, exit_code: int | None, *, group_pod: bool) -> dict[str, Any]:
    """A termination message that is not rankguard's JSON: the kubelet's log tail (the launcher
    died before writing, or an older image). Recognise a CUDA OOM or KV refusal in it, line by
    line from the end, with the agent's own recognisers; else classify by exit code. PyTorch's
    "GPU i" is the pod's own device: the rank on one pod, but not on a group's pod (no rank)."""
    for line in reversed(text.splitlines()):
        seen = recognise(line)
        if isinstance(seen, CudaOom):
            return {
                "kind": CUDA_OOM,
                "rank": None if group_pod else seen.gpu_index,
                "requested_bytes": seen.requested_bytes,
                "free_bytes": seen.free_bytes,
                "total_bytes": seen.total_bytes,
                "message": seen.text,
                "startup_refusal": seen.startup_check,
                "external_weight_bytes": seen.external_weight_bytes,
            }
        if isinstance(seen, KVTooSmall):
            return {"kind": KV_CACHE_TOO_SMALL, "message": seen.text}
    if exit_code == SIGKILL_EXIT_CODE and reason != "OOMKilled":
        # said as what it is: the tail is whatever the launcher logged last, not why it died
        return {"kind": ENGINE_ERROR, "message": SIGKILLED}
    stopped = exit_code in _STOP_EXIT_CODES or reason == "Completed" or exit_code == 0
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    return {"kind": OTHER if stopped else ENGINE_ERROR, "message": tail}


def _classify(terminated: Mapping[str, Any], *, group_pod: bool = False) -> dict[str, Any]:
    reason = str(terminated.get("reason") or "")
    exit_code = terminated.get("exitCode")
    code = exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None
    text = terminated.get("message")
    text = text if isinstance(text, str) else ""
    try:
        msg = tm.parse_termination_message(text)
    except tm.TerminationError:
        info = _from_log_tail(text, reason, code, group_pod=group_pod)
    else:
        kinds: dict[str, TerminationKind] = {
            tm.CUDA_OOM: CUDA_OOM,
            tm.KV_CACHE_TOO_SMALL: KV_CACHE_TOO_SMALL,
            tm.ENGINE_ERROR: ENGINE_ERROR,
            tm.ENGINE_REFUSED: ENGINE_REFUSED,
        }
        info = {
            "kind": kinds.get(msg.reason, OTHER),
            # a group pod's agent writes the global rank; its gpu_index is a device of that pod
            "rank": msg.rank if msg.rank is not None else (msg.gpu_index if msg.nnodes is None else None),
            "requested_bytes": msg.requested_bytes,
            "free_bytes": msg.free_bytes,
            "total_bytes": msg.total_bytes,
            "message": msg.detail or msg.reason,
            "kv_cache_bytes": kv_bytes_from_line(msg.last_kv_line),
            "startup_refusal": msg.startup_check,
            "external_weight_bytes": msg.external_weight_bytes if msg.startup_check else None,
            "phase": msg.phase,
            "free_at_load_bytes": msg.free_at_load_bytes,
            "others_at_load_bytes": msg.others_at_load_bytes,
            "others_peak_bytes": msg.others_peak_bytes,
        }
    # The host cgroup's verdict wins: when the kernel OOM-killed the container, whatever the
    # launcher managed to write (usually "Signaled") is a consequence, not the cause.
    if reason == "OOMKilled":
        info["kind"] = OOM_KILLED
        info["message"] = info.get("message") or "container OOMKilled (host memory limit)"
    info["reason"] = reason
    info["exit_code"] = code
    info["finished_at"] = parse_iso(terminated.get("finishedAt"))
    info["message"] = str(info.get("message") or "")[:_MAX_MESSAGE]
    return info


def terminations(pod: Mapping[str, Any], container: str = VLLM_CONTAINER) -> list[Termination]:
    """Every ended run of `container` visible in the pod's status (0, 1 or 2), oldest first."""
    uid = str(get_path(pod, "metadata", "uid") or "")
    name = str(get_path(pod, "metadata", "name") or "")
    flags = pod_flags(pod)
    template = carried_template_hash(pod)
    group_pod = get_path(pod, "metadata", "labels", GROUP_LABEL) is not None or (
        get_path(pod, "metadata", "labels", ROLE_LABEL) is not None
    )
    out: list[Termination] = []
    for cs in get_path(pod, "status", "containerStatuses") or []:
        if not isinstance(cs, Mapping) or cs.get("name") != container:
            continue
        restarts = cs.get("restartCount")
        restarts = restarts if isinstance(restarts, int) and not isinstance(restarts, bool) else 0
        # (where, run number): see the module docstring for why the numbers differ
        views = (("lastState", restarts - 1), ("state", restarts))
        for where, run in views:
            terminated = get_path(cs, where, "terminated")
            if not isinstance(terminated, Mapping) or run < 0:
                continue
            out.append(
                Termination(
                    pod_name=name,
                    pod_uid=uid,
                    container=container,
                    restart_count=run,
                    flags=flags,
                    template_hash=template,
                    **_classify(terminated, group_pod=group_pod),
                )
            )
    return out


def refused_run(pod: Mapping[str, Any], container: str = VLLM_CONTAINER) -> Termination | None:
    """The latest run of `container` when the image's own vLLM refused its arguments and it has
    not run since (it waits in the kubelet's back-off, or has just ended); None while it runs,
    when its latest run ended otherwise, and for a pod being deleted. Unlike a termination,
    this holds on every pass for as long as the pod refuses, not only the pass that saw it end."""
    if get_path(pod, "metadata", "deletionTimestamp"):
        return None
    for cs in get_path(pod, "status", "containerStatuses") or []:
        if not isinstance(cs, Mapping) or cs.get("name") != container:
            continue
        if isinstance(get_path(cs, "state", "running"), Mapping):
            return None
        ended = terminations(pod, container)  # oldest first: the latest run is the last
        return ended[-1] if ended and ended[-1].kind == ENGINE_REFUSED else None
    return None


def first_unended_run(pod: Mapping[str, Any], container: str = VLLM_CONTAINER) -> int:
    """The number of the earliest run of `container` that has not ended yet in the pod's status
    (its restartCount, one more when that run is already `terminated`; 0 before it started)."""
    for cs in get_path(pod, "status", "containerStatuses") or []:
        if not isinstance(cs, Mapping) or cs.get("name") != container:
            continue
        restarts = cs.get("restartCount")
        restarts = restarts if isinstance(restarts, int) and not isinstance(restarts, bool) else 0
        return restarts + (1 if isinstance(get_path(cs, "state", "terminated"), Mapping) else 0)
    return 0


def new_terminations(
    pods: Sequence[Mapping[str, Any]],
    seen: Sequence[str] | set[str],
    counted_from: Mapping[str, int] | None = None,
) -> list[Termination]:
    """Terminations across `pods` whose key is not in `seen`, each once, oldest first.
    `counted_from`: pod UID -> the first run whose end counts (core/step/trust: the pod was
    trusted before that run ended); a pod not in it counts none. None: every run counts (the
    offline tools, which replay recorded pods without trust's memory)."""
    known = set(seen)
    out: list[Termination] = []
    for pod in pods:
        uid = str(get_path(pod, "metadata", "uid") or "")
        first = 0 if counted_from is None else counted_from.get(uid)
        for t in terminations(pod):
            if first is None or t.restart_count < first:
                continue
            if t.key not in known:
                known.add(t.key)
                out.append(t)
    return sorted(out, key=lambda t: (t.finished_at or 0.0, t.key))


# --------------------------------------------------------------------------------------------
# Rollouts

RolloutPhase = Literal["progressing", "complete", "failed", "unknown"]


@dataclass(frozen=True)
class RolloutState:
    phase: RolloutPhase
    replicas: int  # desired
    updated_replicas: int
    ready_replicas: int
    available_replicas: int
    observed: bool  # the Deployment controller has seen the latest generation
    template_matches: bool  # the Deployment carries the template hash we rendered
    reason: str = ""
    message: str = ""
    # a pod of this template whose vLLM refused its arguments and has not run since (refused_run):
    # why the rollout does not progress, and why no rollback can help
    refused: Termination | None = None
    template_hash: str = ""  # the template whose rollout this is

    @property
    def complete(self) -> bool:
        return self.phase == "complete"

    @property
    def failed(self) -> bool:
        return self.phase == "failed"


class _Counts(TypedDict):
    replicas: int
    updated_replicas: int
    ready_replicas: int
    available_replicas: int


def _count(status: Mapping[str, Any], key: str) -> int:
    v = status.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def rollout_state(
    deployment: Mapping[str, Any] | None, template_hash: str, pods: Sequence[Mapping[str, Any]] = ()
) -> RolloutState:
    """Where the Deployment's rollout of `template_hash` stands, the way `kubectl rollout status`
    judges it: failed once the Progressing condition says ProgressDeadlineExceeded; complete
    when the controller has observed the latest generation and every desired replica is
    updated and available with no old replicas left; progressing otherwise. Unknown when the
    Deployment is missing or does not carry our template yet (the apply has not landed).
    `pods`: the service's pods; one of this template whose vLLM refused its arguments is
    `refused` (the first by name), however long ago the policy saw it end."""
    state = replace(_rollout(deployment, template_hash), template_hash=template_hash)
    if not state.template_matches:
        return state
    ours = sorted(
        (p for p in pods if carried_template_hash(p) == template_hash),
        key=lambda p: str(get_path(p, "metadata", "name") or ""),
    )
    refused = next((r for p in ours if (r := refused_run(p)) is not None), None)
    return state if refused is None else replace(state, refused=refused)


def _rollout(deployment: Mapping[str, Any] | None, template_hash: str) -> RolloutState:
    if not isinstance(deployment, Mapping):
        return RolloutState("unknown", 0, 0, 0, 0, False, False, "NotFound", "the Deployment does not exist")
    spec = deployment.get("spec") if isinstance(deployment.get("spec"), Mapping) else {}
    status = deployment.get("status") if isinstance(deployment.get("status"), Mapping) else {}
    assert isinstance(spec, Mapping) and isinstance(status, Mapping)
    desired = spec.get("replicas", 1)
    desired = desired if isinstance(desired, int) and not isinstance(desired, bool) else 1
    generation = get_path(deployment, "metadata", "generation")
    observed_gen = status.get("observedGeneration")
    observed = isinstance(observed_gen, int) and (
        not isinstance(generation, int) or observed_gen >= generation
    )
    current_hash = get_path(spec, "template", "metadata", "annotations", TEMPLATE_HASH_ANNOTATION)
    matches = current_hash == template_hash
    counts: _Counts = {
        "replicas": desired,
        "updated_replicas": _count(status, "updatedReplicas"),
        "ready_replicas": _count(status, "readyReplicas"),
        "available_replicas": _count(status, "availableReplicas"),
    }
    if not matches:
        return RolloutState(
            "unknown",
            **counts,
            observed=observed,
            template_matches=False,
            reason="TemplateNotApplied",
            message=f"the Deployment does not carry template {template_hash} yet",
        )
    for c in status.get("conditions") or []:
        if (
            isinstance(c, Mapping)
            and c.get("type") == "Progressing"
            and c.get("reason") == "ProgressDeadlineExceeded"
            and observed
        ):
            return RolloutState(
                "failed",
                **counts,
                observed=True,
                template_matches=True,
                reason="ProgressDeadlineExceeded",
                message=str(c.get("message") or "the rollout exceeded its progress deadline"),
            )
    if not observed:
        return RolloutState(
            "progressing",
            **counts,
            observed=False,
            template_matches=True,
            reason="NotObserved",
            message="the Deployment controller has not observed the latest generation yet",
        )
    total = _count(status, "replicas")
    up, avail = counts["updated_replicas"], counts["available_replicas"]
    if up < desired:
        msg = f"{up} of {desired} replicas updated"
    elif total > up:
        msg = f"{total - up} old replicas pending termination"
    elif avail < up:
        msg = f"{avail} of {up} updated replicas available"
    else:
        return RolloutState(
            "complete", **counts, observed=True, template_matches=True, reason="Complete", message=""
        )
    return RolloutState(
        "progressing", **counts, observed=True, template_matches=True, reason="Progressing", message=msg
    )
