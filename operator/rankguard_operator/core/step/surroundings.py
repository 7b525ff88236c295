"""What the serving pods' surroundings add to a pass: the model cache's claim, the agents that
do not report, and the GPU size the nodes' labels state.

`reconcile.step` calls four functions here, so the step itself grows by a few lines (what the
edge reads for them, the claim and the nodes, core/step/gather names):

* `refusal`: a name another, older LLMService holds (core/render/taken_names), or a cache claim
  another LLMService controls: the step applies nothing and says why.
* `claim_effects`: the `ApplyClaim` to carry out before anything is rolled.
* `node_gpu`: one GPU's size from the nodes' GPU Feature Discovery labels (core/budget/gpu_labels),
  where the spec does not give it.
* `settle`: the ModelCacheReady and AgentReady conditions, and one Event per change of
  either's reason (not per pass: the previous condition, as stored, says what was said).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rankguard_operator.core.budget.gpu_labels import NodeGpu, gpu_from_nodes
from rankguard_operator.core.conditions import Condition, condition, drop_condition, set_condition
from rankguard_operator.core.effects import ApplyClaim, PostEvent
from rankguard_operator.core.observe import agent_ready
from rankguard_operator.core.observe.headroom import Observation
from rankguard_operator.core.render import claim as model_cache
from rankguard_operator.core.render.taken_names import taken, taken_message
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.step.world import World


def claim_effects(
    world: World,
    spec: ServiceSpec,
    *,
    first_pass: bool,
    observed_generation: int | None,
    scaled: bool = False,
) -> list[ApplyClaim]:
    """Apply the claim rankguard creates when it is missing, on the first pass and after every
    edit of the spec (as the Service is), before the Deployment needs it. `scaled`: this
    generation changed spec.replicas alone (core/status/scale), which is no edit."""
    body = model_cache.claim_to_apply(
        spec,
        world.name,
        world.namespace,
        world.uid,
        world.cache_claim,
        spec_changed=first_pass or (world.generation != observed_generation and not scaled),
    )
    return [] if body is None else [ApplyClaim(body)]


@dataclass(frozen=True)
class Refusal:
    """Why the step applies nothing this pass: Degraded's reason and message, and the other
    conditions the refusal sets ((type, status, reason, message) each)."""

    reason: str
    message: str
    conditions: tuple[tuple[Condition, str, str, str], ...] = ()
    # its own workload goes to zero at once: a name another service holds shares that service's
    # label and Service, so a pod of this one (both created in the same second, it started
    # before the refusal) would be one of its endpoints, serving another model under its name
    stop: bool = False


NAME_TAKEN = "NameTaken"


def refusal(world: World, spec: ServiceSpec) -> Refusal | None:
    """A name of this service that an older LLMService holds, or a model cache claim another
    LLMService controls (it would be deleted with that service, under this one's pods)."""
    rival = taken(world.name, world.name_rivals)
    if rival is not None:
        return Refusal(NAME_TAKEN, taken_message(world.name, rival), stop=True)
    cache = spec.model_cache
    if cache is None or model_cache.borrowed_from(world.cache_claim, world.uid) is None:
        return None
    status, reason, message = model_cache.condition(
        cache, world.name, world.namespace, world.cache_claim, uid=world.uid
    )
    return Refusal(model_cache.DEGRADED_TAKEN, message, ((model_cache.CONDITION, status, reason, message),))


def node_gpu(world: World, spec: ServiceSpec, kept: NodeGpu | None) -> NodeGpu | None:
    """One GPU's (or MIG slice's) size from the serving pods' nodes' labels; None when the spec
    gives the size (it wins) or no node ever said.

    The labels are read from the nodes the service's pods run on, so they vanish with the
    pods: `kept` (status.nodeGpu, what the labels last said for the same resource) stands in
    while no labelled pod runs. Without it a group replace, which scales every set to zero,
    rendered a template without the GPU's size, which differed from the running one, which
    replaced the group again: a multi-node service with default memory settings never started."""
    if spec.memory.gpu_memory_bytes is not None:
        return None
    resource = spec.resources.gpu_resource_name
    seen = gpu_from_nodes(world.node_labels, resource)
    if seen is not None:
        return seen
    return kept if kept is not None and kept.resource == resource else None


EventRule = Callable[
    [Mapping[str, Any] | None, str, str], tuple[Literal["Normal", "Warning"], str, str] | None
]


@dataclass(frozen=True)
class Settled:
    conditions: list[dict[str, Any]]
    events: tuple[PostEvent, ...]
    agents_unavailable: tuple[str, ...]


def settle(
    conditions: Sequence[Mapping[str, Any]],
    world: World,
    spec: ServiceSpec,
    *,
    current_hash: str | None,
    observation: Observation,
    reported_pods: Sequence[str],
    now_iso: str,
    unavailable_after: float,
) -> Settled:
    """ModelCacheReady and AgentReady set on `conditions` (the status being built; each
    condition as stored before this pass is in it still), with their Events."""
    conds = [dict(c) for c in conditions]
    events: list[PostEvent] = []

    def put(type_: Condition, status: str, reason: str, message: str, event: EventRule) -> None:
        nonlocal conds
        said = event(condition(conds, type_), reason, message)
        if said is not None:
            events.append(PostEvent(*said, repeat=True))
        conds = set_condition(conds, type_, status, reason, message, now_iso, world.generation)

    cache = spec.model_cache
    if cache is None:
        conds = drop_condition(conds, model_cache.CONDITION)
    else:
        put(
            model_cache.CONDITION,
            *model_cache.condition(cache, world.name, world.namespace, world.cache_claim, uid=world.uid),
            model_cache.event,
        )

    verdict = agent_ready.verdict(
        world.pods,
        current_hash,
        fresh_pods=observation.fresh_pods,
        reported_pods=reported_pods,
        misses=world.agent_misses,
        now=world.now,
        bound=unavailable_after,
    )
    if verdict is not None:
        put(agent_ready.CONDITION, verdict.status, verdict.reason, verdict.message, agent_ready.event)
    elif not agent_ready.keeps(condition(conds, agent_ready.CONDITION)):
        put(agent_ready.CONDITION, *agent_ready.waiting(), agent_ready.event)
    return Settled(conds, tuple(events), () if verdict is None else verdict.unavailable)
