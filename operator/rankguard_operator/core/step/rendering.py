"""What a pass renders with, and the workload as it stands after the pass's own applies.

`Renderer` holds the inputs every render of one pass shares (the spec, the plan to render from,
what the engine reported of its start-up, the agent's image); stages that learn something that
changes a render (a measured GPU size, the model the agents read) hand on a new one. `Live` is
the Deployment (or a multi-node service's Deployment-shaped view of its groups) as the API
server will hold it once this pass's applies land, so later stages judge the rollout they made.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.effects import ApplyDeployment, Effect
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.names import REMEDIATION_ID_ANNOTATION
from rankguard_operator.core.render.deployment import render_deployment
from rankguard_operator.core.render.group import GROUP_SET_KIND, GroupInputs, render_group_set
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.step.world import World, after_apply


@dataclass(frozen=True)
class Renderer:
    world: World
    spec: ServiceSpec
    agent_image: str
    prior: Plan | None  # the plan renders start from (the spec's prior, or the measured one)
    startup_free: int | None = None  # what vLLM reported free at start-up (core/status/engine)
    external_weights: int | None = None
    shape: ModelShape | None = None  # the model's shape as resolved for the render

    def render(self, flags: ServingFlags, remediation_id: str | None = None) -> dict[str, Any]:
        """The Deployment (or a multi-node service's group set) for `flags`; a remediation's id
        goes on it as an annotation, so a later pass knows the roll happened."""
        w, spec = self.world, self.spec
        stamp = {REMEDIATION_ID_ANNOTATION: remediation_id} if remediation_id else None
        if spec.distributed is not None:
            inputs = GroupInputs(
                spec,
                flags,
                self.agent_image,
                self.prior,
                startup_free_bytes=self.startup_free,
                external_weight_bytes=self.external_weights,
                shape=self.shape,
            )
            return render_group_set(w.name, w.namespace, w.uid, inputs, revision_annotations=stamp)
        return render_deployment(
            w.name,
            w.namespace,
            w.uid,
            spec,
            flags,
            agent_image=self.agent_image,
            plan=self.prior,
            revision_annotations=stamp,
            startup_free_bytes=self.startup_free,
            external_weight_bytes=self.external_weights,
            shape=self.shape,
        )


@dataclass(frozen=True)
class Live:
    """The workload as it will stand after this pass's applies."""

    deployment: Mapping[str, Any] | None
    # a group set's annotations (a remediation's id): they go on the sets that roll for it
    roll_annotations: Mapping[str, str] = field(default_factory=dict)


def apply(live: Live, body: Mapping[str, Any], **kw: Any) -> tuple[Live, list[Effect]]:
    """Apply `body`: a Deployment is applied now; a group set is applied group by group when the
    pass keeps the workload (core/step/group_roll), so only its annotations are kept here."""
    group = body.get("kind") == GROUP_SET_KIND
    effects: list[Effect] = [] if group else [ApplyDeployment(body, **kw)]
    annotations = (
        dict((body.get("metadata") or {}).get("annotations") or {}) if group else live.roll_annotations
    )
    deployment = after_apply(live.deployment, body)
    if group:
        # no controller stands between rankguard and the groups' view: nothing to observe
        deployment["status"]["observedGeneration"] = deployment["metadata"]["generation"]
    return Live(deployment, annotations), effects
