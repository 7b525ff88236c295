"""The inputs and outputs of one reconcile step (`Settings`, `World`, `Step`) and the small pure
helpers around it: termination keys, the remediation id a Deployment carries, the
Deployment as it stands after an apply, and whether a pass is busy. Apart from `reconcile` so
the step itself reads top to bottom; the room's face (`core.step`) hands them on to the edge.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rankguard_operator.core import policy
from rankguard_operator.core.effects import Effect
from rankguard_operator.core.model.resolve import ConfigRead
from rankguard_operator.core.names import REMEDIATION_ID_ANNOTATION
from rankguard_operator.core.observe.agent_ready import AgentMiss
from rankguard_operator.core.observe.headroom import ReportInput
from rankguard_operator.core.observe.pods import Termination, deployment_template_hash, pod_ready
from rankguard_operator.core.render.taken_names import NameRivals
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.figures import (
    Figures,
    figures,
    memory_terminations,
    phase_change,
    rank_label,
)
from rankguard_operator.core.status.patch import merged_status
from rankguard_operator.core.status.service_state import ServiceState

HANDLED_LIMIT = 64  # termination keys kept: far more than the runs visible in pod statuses

# --------------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class Settings:
    """What the operator was configured with that a step needs (built once at start-up)."""

    agent_image: str
    stale_after: float = 30.0  # seconds after which an agent report is too old to act on
    agent_unavailable_after: float = 60.0  # a ready pod without a report this long: AgentReady False


@dataclass(frozen=True)
class World:
    """What the edge observed for one pass."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: Mapping[str, Any]  # the LLMService's spec as stored (the API server defaulted it)
    now: float
    new_id: str  # the id a remediation decided in this step will carry (the edge makes it)
    deployment: Mapping[str, Any] | None = None
    # a multi-node service's StatefulSets (spec.distributed; also any left from one)
    statefulsets: Sequence[Mapping[str, Any]] = ()
    pods: Sequence[Mapping[str, Any]] = ()
    # pod UID -> the first run of its vllm container whose end counts (core/step/trust: only
    # runs that ended after the pod was seen trusted); None: every run counts (offline tools)
    counted_runs: Mapping[str, int] | None = None
    # the service's LeaderWorkerSet as read (None: none, or the LWS CRD is not installed); read
    # only while the spec asks for one or status records one (core/step/keep)
    leader_worker_set: Mapping[str, Any] | None = None
    reports: Sequence[ReportInput] = ()
    model_config: ConfigRead | None = None  # spec.model.configMap's document, as the edge read it
    cache_claim: Mapping[str, Any] | None = None  # spec.modelCache's claim as read (None: not there)
    agent_misses: Sequence[AgentMiss] = ()  # why scraped pods sent no valid report (core/observe/agent_ready)
    node_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # serving pods' nodes
    # the other LLMServices that take one of this one's names (core/render/taken_names); None: unknown
    name_rivals: NameRivals | None = None
    # the Warning Events of the objects core/observe/pod_blockers.event_subjects names, by the
    # involved object's uid (a volume the kubelet cannot mount is said only in an Event)
    events: Mapping[str, Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    # seconds since this operator last wrote the service's status (None: not since it started);
    # a write that only lets figures drift waits up to core/status/hold's bound
    status_age: float | None = None


class OomSeen(NamedTuple):
    """A memory termination, as the operator counts it (once, acted upon or not)."""

    key: str
    kind: str
    rank: str


@dataclass(frozen=True)
class Step:
    state: ServiceState  # the state after every effect has been carried out
    effects: tuple[Effect, ...]
    decision: policy.Decision | None = None  # None when the spec was refused
    phase: str = ""
    agents_unavailable: tuple[str, ...] = ()  # ready pods past the bound without a report
    # seconds after which a verdict falls due with nothing else changing (a pod unschedulable
    # for long enough, core/observe/blockers): the edge should pass again by then; None: no such clock
    pass_again_after: float | None = None
    spec: ServiceSpec | None = None  # the spec as this step parsed it (None: refused)
    # the vLLM terminations this step saw for the first time (not yet in handledTerminations)
    terminations: tuple[Termination, ...] = ()
    # whether something changes without a watch event or an agent's news (a remediation under
    # way, pods starting on a node, an agent not answering): the edge passes at the fast cadence
    busy: bool = False
    before: ServiceState | None = None  # the state the step started from

    def figures(self) -> Figures:
        """The service's gauges, from the status as the step leaves it."""
        return figures(self.state.raw, self.spec)

    def phase_change(self) -> str | None:
        """One line when the step changed the service's phase."""
        return None if self.before is None else phase_change(self.before.raw, self.state.raw)

    def ooms(self) -> tuple[OomSeen, ...]:
        """The memory terminations among this step's new ones."""
        return tuple(OomSeen(t.key, t.kind, rank_label(t)) for t in memory_terminations(self.terminations))


# --------------------------------------------------------------------------------------------
# Helpers


def merge_keys(keys: Sequence[str], more: Sequence[str]) -> tuple[str, ...]:
    """`keys` + the new ones of `more`, in order, the newest HANDLED_LIMIT kept."""
    out = list(keys)
    for k in more:
        if k not in out:
            out.append(k)
    return tuple(out[-HANDLED_LIMIT:])


def remediation_id_of(deployment: Mapping[str, Any] | None) -> str | None:
    annotations = ((deployment or {}).get("metadata") or {}).get("annotations") or {}
    v = annotations.get(REMEDIATION_ID_ANNOTATION)
    return v if isinstance(v, str) else None


def after_apply(live: Mapping[str, Any] | None, applied: Mapping[str, Any]) -> dict[str, Any]:
    """The Deployment as the API server will hold it right after `applied` lands: its spec and
    metadata, the live status, and a new generation when the spec changed, which the
    controller has not observed yet (so the rollout reads as progressing)."""
    live_meta = (live or {}).get("metadata") or {}
    live_gen = live_meta.get("generation")
    gen = live_gen if isinstance(live_gen, int) else 0
    if live is None or live.get("spec") != applied.get("spec"):
        gen += 1
    return {
        **applied,
        "metadata": {**applied.get("metadata", {}), "generation": gen},
        "status": dict((live or {}).get("status") or {}),
    }


def same_template(live: Mapping[str, Any] | None, want: Mapping[str, Any], replicas: int) -> bool:
    """The live Deployment already runs what we would render (the hash covers the template)."""
    if live is None:
        return False
    live_replicas = (live.get("spec") or {}).get("replicas")
    return deployment_template_hash(live) == deployment_template_hash(want) and (live_replicas == replicas)


def busy(state: ServiceState, world: World) -> bool:
    """A Running service's agents wake it when their reports are news (edge/report_feed), and
    the step names when its own clocks fall due (`pass_again_after`): only a remediation under
    way, an agent not answering (AgentReady's bound runs) and pods still starting on a node pass
    at the fast cadence."""
    starting = any((p.get("spec") or {}).get("nodeName") and not pod_ready(p) for p in world.pods)
    return bool(state.raw.get("pendingRemediation")) or bool(world.agent_misses) or starting


def with_intent(state: ServiceState, pending: Mapping[str, Any]) -> ServiceState:
    """The state as stored once a WriteIntent has landed."""
    return ServiceState.from_status(merged_status(state.raw, {"pendingRemediation": dict(pending)}))
