"""The pass's first stage, before any I/O of its own: what the edge must read for it, from the
spec parsed once.

`needs` parses the LLMService's spec (the only parse of a pass: `reconcile.step` takes the
result instead of parsing again) and names everything else the pass reads besides the watched
objects: the model's ConfigMap, the cache claim, the nodes whose labels may size the GPU, the
agents to poll, the objects whose Warning Events may explain a stuck pod, and the headroom lines
the agents' long-polls wake on.

Pure: no I/O, no clock (`now` is an argument).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.observe.pod_blockers import event_subjects
from rankguard_operator.core.observe.pods import (
    carried_template_hash,
    deployment_template_hash,
    pod_ip,
    pod_ready,
)
from rankguard_operator.core.policy.trackers import headroom_lines
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec

ScrapeTarget = tuple[str, str, int]  # (pod, IP, agent port)


@dataclass(frozen=True)
class Needs:
    """What one pass reads besides the Deployment, the StatefulSets and the pods."""

    spec: ServiceSpec | SpecError  # the spec, parsed once for the whole pass (or why it cannot be)
    config_map: tuple[str, str] | None = None  # spec.model.configMap: (name, key)
    claim: str | None = None  # spec.modelCache's claim
    nodes: tuple[str, ...] = ()  # the serving pods' nodes, for their GPU labels
    targets: tuple[ScrapeTarget, ...] = ()  # the agents worth polling
    event_subjects: tuple[str, ...] = ()  # uids whose Warning Events say why a pod is stuck
    lines: tuple[int, ...] = ()  # the headroom lines the agents' long-polls wake on (bytes free)

    @property
    def parsed(self) -> ServiceSpec | None:
        return self.spec if isinstance(self.spec, ServiceSpec) else None


def needs(
    world_spec: Mapping[str, Any],
    name: str,
    *,
    deployment: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    statefulsets: Sequence[Mapping[str, Any]] = (),
    now: float = 0.0,
) -> Needs:
    """Everything a pass reads, from the spec as stored and the trusted pods (core/step/trust).
    An unreadable spec needs nothing read: the step says why."""
    subjects = tuple(event_subjects(pods, statefulsets, now))
    try:
        spec = parse_spec(world_spec)
    except SpecError as e:
        return Needs(e, event_subjects=subjects)
    model = spec.model
    return Needs(
        spec,
        config_map=None if model.config_map is None else (model.config_map, model.config_map_key),
        claim=None if spec.model_cache is None else spec.model_cache.claim(name),
        nodes=_nodes(spec, pods),
        targets=scrape_targets(spec, deployment, pods, statefulsets),
        event_subjects=subjects,
        lines=headroom_lines(spec),
    )


def _nodes(spec: ServiceSpec, pods: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The nodes whose labels may size the GPU (only when the spec does not give it): every
    node a serving pod is scheduled on."""
    if spec.memory.gpu_memory_bytes is not None:
        return ()
    nodes = {n for p in pods for n in [(p.get("spec") or {}).get("nodeName")] if isinstance(n, str) and n}
    return tuple(sorted(nodes))


def scrape_targets(
    spec: ServiceSpec,
    deployment: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    statefulsets: Sequence[Mapping[str, Any]] = (),
) -> tuple[ScrapeTarget, ...]:
    """(pod, IP, agent port) of the pods worth polling: ready, with an IP, created from the
    template the Deployment (or a multi-node service's StatefulSets) holds now. `step` keeps
    only the reports of the template it wants, so this is an economy, not a decision."""
    live = {deployment_template_hash(deployment)} | {deployment_template_hash(s) for s in statefulsets}
    live.discard(None)
    out = []
    for p in pods:
        ip = pod_ip(p)
        if ip and pod_ready(p) and carried_template_hash(p) in live:
            out.append((str(p["metadata"]["name"]), ip, spec.agent.port))
    return tuple(out)
