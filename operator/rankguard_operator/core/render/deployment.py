"""Renderers: an LLMService spec + the serving flags in effect -> the Deployment and Service.

The output is plain dicts in the API's camelCase, ready for server-side apply with field
manager `rankguard`: only the fields rendered here are owned by rankguard, so a person's
edits to other fields survive. The agent is injected the way the OpenTelemetry operator
injects auto-instrumentation: an init container copies the pure-Python agent into an
emptyDir, and the vLLM container's command becomes
`python3 /opt/rankguard/agent/rankguard-agent launch … -- vllm serve MODEL FLAGS…` (DESIGN §2
step 2; the pod itself is render/pod's). The user's `spec.template` (core/spec/template) is
merged last: their env, volumes, scheduling fields and sidecars around what rankguard owns.
The model cache (spec.modelCache) is a PersistentVolumeClaim mounted at its mountPath with
HF_HOME pointing there.

The pod template carries `rankguard.io/template-hash` (a hash of everything else in the
template) so the caller can tell a real change from a re-render of the same thing, and
`rankguard.io/serving-flags` so a terminated pod says which budget it ran with.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from rankguard_operator.core.budget.planner import Plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.model.hf_config import canonical_json
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.names import (
    FLAGS_ANNOTATION,
    ROLE_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    VLLM_HTTP_PORT,
    labels,
    owner_reference,
    selector,
    service_name,
)
from rankguard_operator.core.render.pod import (
    STARTUP_PROBE_PERIOD_SECONDS,
    pod_spec,
    startup_failures,
)
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.spec.template import apply_template

# The Deployment's progress deadline must outlast the startup probe plus the agent's own probe
# (300 s by default), or every slow start would be reported as a failed rollout and rolled back.
PROGRESS_DEADLINE_MARGIN_SECONDS = 600


def template_hash(deployment: Mapping[str, Any]) -> str:
    """Stable hash (16 hex digits) of a Deployment's pod template, ignoring the hash annotation
    itself: equal for equal renders, different as soon as anything that would roll changes."""
    # a shallow copy is enough: only `metadata` is replaced, never changed in place
    template = dict(deployment.get("spec", {}).get("template", {}))
    meta = template.get("metadata") or {}
    annotations = dict(meta.get("annotations") or {})
    annotations.pop(TEMPLATE_HASH_ANNOTATION, None)
    if meta:
        template["metadata"] = {**meta, "annotations": annotations}
    return hashlib.sha256(canonical_json(template).encode()).hexdigest()[:16]


def render_deployment(
    name: str,
    namespace: str,
    owner_uid: str,
    spec: ServiceSpec,
    flags: ServingFlags,
    *,
    agent_image: str,
    plan: Plan | None,
    revision_annotations: Mapping[str, str] | None = None,
    startup_free_bytes: int | None = None,
    external_weight_bytes: int | None = None,
    shape: ModelShape | None = None,
) -> dict[str, Any]:
    """The serving Deployment.

    `plan` is the spec's prior plan (budget.prior_plan; None when the GPU size is not known
    yet): it sizes the start-up utilisation and the agent's probe collectives.
    `startup_free_bytes`: the least free memory vLLM measured at a worker's start-up (kept in
    status), which that utilisation must stay under; `external_weight_bytes`: the weights another
    process holds on one GPU (kept in status after vLLM refused for them), which it must exceed.
    `shape`: the model's shape as the spec alone names it, which sizes the agent's probe while
    there is no plan (see `agent_args`).
    `revision_annotations` go on the Deployment's own metadata (never the pod template), so
    bookkeeping such as a remediation id never rolls the pods.
    """
    pod_labels = labels(name)
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(pod_labels),
            "ownerReferences": [owner_reference(name, owner_uid)],
        },
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector(name)},
            # maxSurge 0: a surge pod would need another tp×pp free GPUs, which a GPU cluster
            # rarely has, so it would sit Pending and the roll would never progress. Replace in
            # place, one pod at a time, instead.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "revisionHistoryLimit": 10,
            "progressDeadlineSeconds": STARTUP_PROBE_PERIOD_SECONDS * startup_failures(spec)
            + PROGRESS_DEADLINE_MARGIN_SECONDS,
            "template": {
                "metadata": {
                    "labels": dict(pod_labels),
                    "annotations": {FLAGS_ANNOTATION: canonical_json(flags.to_status())},
                },
                "spec": pod_spec(
                    name,
                    spec,
                    flags,
                    agent_image,
                    plan,
                    startup_free_bytes=startup_free_bytes,
                    external_weight_bytes=external_weight_bytes,
                    shape=shape,
                ),
            },
        },
    }
    template = deployment["spec"]["template"]
    apply_template(spec.template, template["metadata"], template["spec"])
    if revision_annotations:
        deployment["metadata"]["annotations"] = dict(revision_annotations)
    deployment["spec"]["template"]["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = template_hash(
        deployment
    )
    return deployment


def serving_selector(name: str, *, multi_node: bool) -> dict[str, str]:
    """The labels of the pods that serve the service's HTTP: every pod of a one-pod-per-replica
    service; a multi-node service's groups' leaders only (the workers serve no HTTP). Its
    Service selects them, and status.selector (the scale subresource's) names them."""
    return {**selector(name), ROLE_LABEL: "leader"} if multi_node else selector(name)


def selector_text(match: Mapping[str, str]) -> str:
    """A label selector as Kubernetes writes one in a string (`k1=v1,k2=v2`, keys sorted, as
    labels.SelectorFromSet(...).String() does): the scale subresource's status.selector, which
    an HPA parses to find the pods. Label keys and values never hold `,` or `=`."""
    return ",".join(f"{k}={v}" for k, v in sorted(match.items()))


def render_service(name: str, namespace: str, owner_uid: str, spec: ServiceSpec) -> dict[str, Any]:
    """ClusterIP Service for vLLM's OpenAI API (port 8000) and the agent's endpoints. A
    multi-node service's requests go to its groups' leaders only (the workers serve no HTTP)."""
    pick = serving_selector(name, multi_node=spec.distributed is not None)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(name),
            "namespace": namespace,
            "labels": labels(name),
            "ownerReferences": [owner_reference(name, owner_uid)],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": pick,
            "ports": [
                {"name": "http", "port": VLLM_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "agent", "port": spec.agent.port, "targetPort": "agent", "protocol": "TCP"},
            ],
        },
    }
