"""The rules LeaderWorkerSet's admission webhook enforces, as a pure checker.

The LWS CRD's schema (third_party/lws/) is what a real API server checks; the rules below are
what LWS's own validating webhook adds on top, and the webhook cannot run here (its controller
cannot be built without the Go module proxy). Mirrored from kubernetes-sigs/lws v0.10.0,
pkg/webhooks/leaderworkerset_webhook.go: `generalValidate` (create and update) and
`ValidateUpdate` (update only, given the object it replaces). Each rule below names the Go it
mirrors; a message carries the webhook's own text after the field path.

The webhook sees the object after defaulting: the CRD schema's defaults (replicas 1, size 1,
maxUnavailable 1, maxSurge 0, partition 0) and the mutating webhook's `Default` (a missing
rollingUpdateConfiguration becomes {1, 0, 0}, a missing networkConfig becomes Shared), so
`lws_problems` applies the same defaults first.

Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, TypeGuard

# api/leaderworkerset/v1/leaderworkerset_types.go, SubGroupExclusiveKeyAnnotationKey
SUBGROUP_EXCLUSIVE_TOPOLOGY_ANNOTATION = "leaderworkerset.sigs.k8s.io/subgroup-exclusive-topology"
LEADER_EXCLUDED = "LeaderExcluded"  # SubGroupPolicyTypeLeaderExcluded
MAX_REPLICAS = 1_000_000
MAX_INT32 = 2**31 - 1

# k8s.io/apimachinery/pkg/util/validation: the name and metadata checks ValidateObjectMeta runs
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_PERCENT = re.compile(r"^[0-9]+%$")
_MAX_LABEL = 63
_MAX_SUBDOMAIN = 253
_MAX_ANNOTATIONS_BYTES = 256 * 1024  # TotalAnnotationSizeLimitB

_ROLLING = "spec.rolloutStrategy.rollingUpdateConfiguration"
_SUBGROUP_SIZE = "spec.leaderWorkerTemplate.SubGroupPolicy.subGroupSize"  # the webhook's spelling


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


# --------------------------------------------------------------------------------------------
# Defaulting: what the webhook sees


def defaulted(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The spec the validating webhook receives: the CRD schema's defaults, then the mutating
    webhook's `Default` (restartPolicy, rolloutStrategy, networkConfig). A copy; `obj` is kept."""
    spec = dict(_get(obj, "spec") or {})
    spec.setdefault("replicas", 1)  # +kubebuilder:default=1
    lwt = dict(spec.get("leaderWorkerTemplate") or {})
    lwt.setdefault("size", 1)  # +kubebuilder:default=1
    lwt.setdefault("restartPolicy", "RecreateGroupOnPodRestart")
    if lwt["restartPolicy"] == "Default":  # DeprecatedDefaultRestartPolicy -> None
        lwt["restartPolicy"] = "None"
    spec["leaderWorkerTemplate"] = lwt
    rollout = dict(spec.get("rolloutStrategy") or {})
    rollout.setdefault("type", "RollingUpdate")
    config = rollout.get("rollingUpdateConfiguration")
    if config is None and rollout["type"] == "RollingUpdate":
        config = {"maxUnavailable": 1, "maxSurge": 0, "partition": 0}
    if config is not None:
        # the fields' own defaults (a null is defaulted like a missing field)
        config = {"maxUnavailable": 1, "maxSurge": 0, "partition": 0} | {
            k: v for k, v in config.items() if v is not None
        }
        rollout["rollingUpdateConfiguration"] = config
    spec["rolloutStrategy"] = rollout
    network = spec.get("networkConfig")
    if network is None:
        spec["networkConfig"] = {"subdomainPolicy": "Shared"}
    elif network.get("subdomainPolicy") is None:
        spec["networkConfig"] = {**network, "subdomainPolicy": "Shared"}
    spec.setdefault("startupPolicy", "LeaderCreated")  # +kubebuilder:default=LeaderCreated
    return {**obj, "spec": spec}


# --------------------------------------------------------------------------------------------
# metadata: apivalidation.ValidateObjectMeta(&lws.ObjectMeta, true, NameIsDNS1035Label, ...)


def _dns1035(value: str) -> list[str]:
    out = []
    if len(value) > _MAX_LABEL:
        out.append(f"must be no more than {_MAX_LABEL} characters")
    if not _DNS1035_LABEL.match(value):
        out.append(
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with "
            "an alphabetic character, and end with an alphanumeric character"
        )
    return out


def _qualified_name(key: str) -> list[str]:
    """utilvalidation.IsQualifiedName: `[prefix/]name`."""
    parts = key.split("/")
    if len(parts) > 2:
        return ["a qualified name must consist of a name with an optional DNS subdomain prefix and '/'"]
    out = []
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            out.append("prefix part must be non-empty")
        elif len(prefix) > _MAX_SUBDOMAIN or not _DNS1123_SUBDOMAIN.match(prefix):
            out.append("prefix part must be a lowercase RFC 1123 subdomain")
    name = parts[-1]
    if not name or len(name) > _MAX_LABEL or not _QUALIFIED_NAME.match(name):
        out.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', start and end "
            "with an alphanumeric character, at most 63 characters"
        )
    return out


def _metadata_problems(meta: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    name, generate = meta.get("name"), meta.get("generateName")
    # ValidateObjectMeta: name or generateName is required
    if not name and not generate:
        out.append("metadata.name: Required value: name or generateName is required")
    # ValidateNameFunc(NameIsDNS1035Label): "the lws name is used as the name for headless
    # service, it must be DNS-1035 compliant"
    if name:
        out += [f"metadata.name: Invalid value: {name!r}: {m}" for m in _dns1035(str(name))]
    # ValidateObjectMeta(requiresNamespace=true): a DNS-1123 label
    ns = meta.get("namespace")
    if not ns:
        out.append("metadata.namespace: Required value")
    elif len(ns) > _MAX_LABEL or not _DNS1123_LABEL.match(ns):
        out.append(f"metadata.namespace: Invalid value: {ns!r}: a lowercase RFC 1123 label")
    # ValidateLabels: qualified-name keys, label values
    for key, value in (meta.get("labels") or {}).items():
        out += [f"metadata.labels: Invalid value: {key!r}: {m}" for m in _qualified_name(str(key))]
        if not isinstance(value, str) or len(value) > _MAX_LABEL or not _LABEL_VALUE.match(value):
            out.append(
                f"metadata.labels: Invalid value: {value!r}: a valid label must be an empty string "
                "or up to 63 alphanumeric characters, '-', '_' or '.', starting and ending with an "
                "alphanumeric character"
            )
    # ValidateAnnotations: qualified-name keys (lower-cased), 256 KiB in all
    annotations = meta.get("annotations") or {}
    for key in annotations:
        out += [f"metadata.annotations: Invalid value: {key!r}: {m}" for m in _qualified_name(key.lower())]
    size = sum(len(k) + len(str(v)) for k, v in annotations.items())
    if size > _MAX_ANNOTATIONS_BYTES:
        out.append(f"metadata.annotations: Too long: must have at most {_MAX_ANNOTATIONS_BYTES} bytes")
    # ValidateOwnerReferences: apiVersion, kind, name, uid set; at most one controller
    refs = meta.get("ownerReferences") or []
    for i, ref in enumerate(refs):
        for required in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(required):
                out.append(
                    f"metadata.ownerReferences[{i}].{required}: Invalid value: {required} must not be empty"
                )
    controllers = [r for r in refs if r.get("controller") is True]
    if len(controllers) > 1:
        out.append(
            "metadata.ownerReferences: Invalid value: Only one reference can have Controller set to true"
        )
    return out


# --------------------------------------------------------------------------------------------
# spec: generalValidate


def _int_or_percent(value: Any, path: str) -> list[str]:
    """ValidatePositiveIntOrPercent and IsNotMoreThan100Percent."""
    if isinstance(value, str):
        if not _PERCENT.match(value):
            # utilvalidation.IsValidPercent
            return [
                f"{path}: Invalid value: {value!r}: a valid percent string must be a numeric string "
                "followed by an ending '%' (e.g. '1%',  or '93%', regex used for validation is '[0-9]+%')"
            ]
        if int(value[:-1]) > 100:
            return [f"{path}: Invalid value: {value!r}: must not be greater than 100%"]
        return []
    if _is_int(value):
        # validateNonnegativeField
        return [f"{path}: Invalid value: {value}: must be greater than or equal to 0"] if value < 0 else []
    return [f"{path}: Invalid value: {value!r}: must be an integer or percentage (e.g '5%%')"]


def _scaled(value: Any, total: int, round_up: bool) -> int | None:
    """intstr.GetScaledValueFromIntOrPercent; None where it returns an error."""
    if _is_int(value):
        return int(value)
    if not isinstance(value, str) or not value.endswith("%"):
        return None  # "invalid type: string is not a percentage"
    try:
        percent = int(value[:-1])  # strconv.Atoi
    except ValueError:
        return None
    exact = percent * total / 100
    return math.ceil(exact) if round_up else math.floor(exact)


def _subgroup_problems(size: int, policy: Mapping[str, Any]) -> list[str]:
    """validateUpdateSubGroupPolicy."""
    sub = policy.get("subGroupSize")
    if not _is_int(sub):
        # The webhook dereferences SubGroupSize unchecked: nil is refused (as a recovered panic).
        return [f"{_SUBGROUP_SIZE}: Required value: subGroupSize must be set when subGroupPolicy is"]
    out = []
    if sub < 1:
        out.append(f"{_SUBGROUP_SIZE}: Invalid value: {sub}: subGroupSize must be equal or greater than 1")
        return out  # the modulo checks below would divide by zero (Go panics)
    if size % sub != 0 and (size - 1) % sub != 0:
        out.append(
            f"{_SUBGROUP_SIZE}: Invalid value: {sub}: size or size - 1 must be divisible by subGroupSize"
        )
    if size < sub:
        out.append(f"{_SUBGROUP_SIZE}: Invalid value: {sub}: subGroupSize cannot be larger than size")
    if policy.get("subGroupPolicyType") == LEADER_EXCLUDED and (size - 1) % sub != 0:
        out.append(
            f"{_SUBGROUP_SIZE}: Invalid value: {sub}: size-1 must be divisible by subGroupSize when using "
            "LeaderExcluded"
        )
    return out


def _spec_problems(obj: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    spec = obj["spec"]
    lwt = spec["leaderWorkerTemplate"]
    replicas, size = spec["replicas"], lwt["size"]
    if not _is_int(replicas):
        return [f"spec.replicas: Invalid value: {replicas!r}: must be an integer"]
    if not _is_int(size):
        return [f"spec.leaderWorkerTemplate.size: Invalid value: {size!r}: must be an integer"]

    # "Ensure replicas and groups number are valid"
    if replicas < 0:
        out.append(f"spec.replicas: Invalid value: {replicas}: replicas must be equal or greater than 0")
    if replicas > MAX_REPLICAS:
        out.append(
            f"spec.replicas: Invalid value: {replicas}: replicas must be equal or less than {MAX_REPLICAS}"
        )
    if size < 1:
        out.append(
            f"spec.leaderWorkerTemplate.size: Invalid value: {size}: size must be equal or greater than 1"
        )
    if replicas * size > MAX_INT32:
        out.append(
            f"spec.replicas: Invalid value: {replicas}: the product of replicas and worker replicas must "
            f"not exceed {MAX_INT32}"
        )

    config = spec["rolloutStrategy"].get("rollingUpdateConfiguration")
    if config is not None:
        max_unavailable, max_surge = config.get("maxUnavailable"), config.get("maxSurge")
        # ValidatePositiveIntOrPercent + IsNotMoreThan100Percent ("aligned with Statefulset")
        out += _int_or_percent(max_unavailable, f"{_ROLLING}.maxUnavailable")
        out += _int_or_percent(max_surge, f"{_ROLLING}.maxSurge")
        # "Validate partition value": validateNonnegativeField
        partition = config.get("partition")
        if _is_int(partition) and partition < 0:
            out.append(
                f"{_ROLLING}.partition: Invalid value: {partition}: must be greater than or equal to 0"
            )
        # GetScaledValueFromIntOrPercent(maxUnavailable, replicas, false) / (maxSurge, replicas, true)
        unavailable = _scaled(max_unavailable, replicas, round_up=False)
        surge = _scaled(max_surge, replicas, round_up=True)
        if unavailable is None:
            out.append(f"{_ROLLING}.maxUnavailable: Invalid value: {max_unavailable!r}: invalid value")
        if surge is None:
            out.append(f"{_ROLLING}.maxSurge: Invalid value: {max_surge!r}: invalid value")
        # "Both MaxSurge and MaxUnavailable cannot be zero." (an error above counts as 0, as in Go)
        if (unavailable or 0) == 0 and (surge or 0) == 0 and replicas != 0:
            out.append(
                f"{_ROLLING}.maxUnavailable: Invalid value: {max_unavailable!r}: "
                "must not be 0 when `maxSurge` is 0"
            )

    policy = lwt.get("subGroupPolicy")
    if policy is not None:
        out += _subgroup_problems(size, policy)
    else:
        annotations = _get(obj, "metadata", "annotations") or {}
        if SUBGROUP_EXCLUSIVE_TOPOLOGY_ANNOTATION in annotations:
            out.append(
                f"metadata.annotations.{SUBGROUP_EXCLUSIVE_TOPOLOGY_ANNOTATION}: Invalid value: "
                f"{annotations[SUBGROUP_EXCLUSIVE_TOPOLOGY_ANNOTATION]!r}: cannot have "
                "subgroup-exclusive-topology without subGroupSize set"
            )
    return out


# --------------------------------------------------------------------------------------------
# ValidateUpdate: the rules that compare with the object being replaced


def _update_problems(raw_new: Mapping[str, Any], new: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    new_policy = _get(new, "spec", "leaderWorkerTemplate", "subGroupPolicy")
    old_policy = _get(old, "spec", "leaderWorkerTemplate", "subGroupPolicy")
    # ValidateImmutableField(new SubGroupSize, old SubGroupSize)
    if (
        new_policy is not None
        and old_policy is not None
        and new_policy.get("subGroupSize") != old_policy.get("subGroupSize")
    ):
        out.append(f"{_SUBGROUP_SIZE}: Invalid value: {new_policy.get('subGroupSize')}: field is immutable")
    # "cannot enable subGroupSize after the lws is already created"
    if new_policy is not None and old_policy is None:
        out.append(
            f"{_SUBGROUP_SIZE}: Invalid value: {new_policy.get('subGroupSize')}: cannot enable subGroupSize "
            "after the lws is already created"
        )
    # "cannot remove subGroupSize after enabled"
    if new_policy is None and old_policy is not None:
        out.append(
            f"{_SUBGROUP_SIZE}: Invalid value: {old_policy.get('subGroupSize')}: cannot remove subGroupSize "
            "after enabled"
        )
    # "cannot set subdomainPolicy as null". Checked on the object as sent: the mutating webhook
    # would fill a null subdomainPolicy with Shared first, silently changing the policy.
    network = _get(raw_new, "spec", "networkConfig")
    if network is not None and network.get("subdomainPolicy") is None:
        out.append(
            "spec.networkConfig.subdomainPolicy: Invalid value: null: cannot set subdomainPolicy as null"
        )
    return out


def lws_problems(obj: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> list[str]:
    """What LWS v0.10.0's validating webhook would refuse in the LeaderWorkerSet `obj`, one
    "<field path>: <reason>" line per refusal; empty when it would admit it. With `old` (the
    object `obj` replaces), the update-only rules apply too."""
    new = defaulted(obj)
    out = _metadata_problems(_get(obj, "metadata") or {})
    out += _spec_problems(new)
    if old is not None:
        out += _update_problems(obj, new, defaulted(old))
    return out
