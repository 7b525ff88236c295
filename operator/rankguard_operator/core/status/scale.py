"""The scale subresource's status fields (crds/llmservice.yaml `subresources.scale`):
`status.replicas`, the replicas the workload has now, and `status.selector`, the serving pods'
label selector as a string. `kubectl scale`, an HPA and KEDA read them through `.../scale`; an
HPA will not act without a selector, so every pass writes both, a pass that refuses the spec too.

A multi-node service's replicas are its groups (core/observe/groups.group_view counts them), and
its selector names the groups' leaders: they serve its HTTP and run its engine's API, the
workers serve nothing an autoscaler could read (the Service selects the same pods).

A scaler's change of spec.replicas raises the generation as any edit does, but it is no edit:
the spec's key (`spec_key`, status.specKey) leaves the replicas out, so a pass tells the two
apart, and the conditions written for the spec before a scale hold for the spec after it
(`as_of_scale`: a sticky Degraded, core/status/build, ends with an edit of the spec, not a scale).

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from rankguard_operator.core.model.hf_config import canonical_json
from rankguard_operator.core.render.deployment import selector_text, serving_selector


def scale_status(name: str, *, multi_node: bool, workload: Mapping[str, Any] | None) -> dict[str, Any]:
    """`status.replicas` and `status.selector`. `workload`: the Deployment as it stands, or a
    multi-node service's Deployment-shaped view of its groups (None: none exists, 0 replicas).
    `status.replicas` counts what exists, as a Deployment's own does (pods of an old template
    still running in a roll included), so an HPA's current replicas are what the cluster holds."""
    replicas = ((workload or {}).get("status") or {}).get("replicas")
    return {
        "replicas": replicas if isinstance(replicas, int) and not isinstance(replicas, bool) else 0,
        "selector": selector_text(serving_selector(name, multi_node=multi_node)),
    }


def spec_key(spec: Mapping[str, Any]) -> str:
    """A digest (16 hex digits) of the spec as stored, less spec.replicas: equal before and after
    a scale, different after any other edit."""
    return hashlib.sha256(
        canonical_json({k: v for k, v in spec.items() if k != "replicas"}).encode()
    ).hexdigest()[:16]


def scaled_only(old: Mapping[str, Any], generation: int, spec: Mapping[str, Any]) -> bool:
    """This generation differs from the last pass's only in spec.replicas. A status written
    before status.specKey existed says nothing: any new generation is taken as an edit."""
    return old.get("observedGeneration") != generation and old.get("specKey") == spec_key(spec)


def as_of_scale(old: Mapping[str, Any], generation: int) -> dict[str, Any]:
    """`old` with the conditions written for the last pass's generation carried to `generation`:
    after a scale they are about the same spec (a sticky Degraded is kept until an edit)."""
    was = old.get("observedGeneration")
    conditions = [
        {**c, "observedGeneration": generation}
        if isinstance(c, Mapping) and c.get("observedGeneration") == was
        else c
        for c in old.get("conditions") or []
    ]
    return {**old, "conditions": conditions}
