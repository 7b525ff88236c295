"""The files a pod's volumes hold, from the pod spec and lookups (no I/O of its own).

emptyDir volumes are empty folders; configMap, secret, downwardAPI and projected volumes
(the service-account token volume every pod gets) are folders of files computed here;
hostPath volumes are the host path itself. The kubelet writes what `volume_files` returns.

A persistentVolumeClaim volume is the folder of the PersistentVolume bound to the claim:
`claim_volume_name` checks the claim (it exists in the pod's namespace, is not being
deleted, is Bound) and `claim_path` the volume (it is the one bound to this claim and has a
`hostPath` or `local` path). Both raise SpecError("FailedMount", …) with the kubelet's
wording, so the container waits in ContainerCreating and the kubelet retries.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rankguard_sim.kubelet.pod.spec import ObjectLookup, Pod, PodFacts, SpecError, field_value

# (the pod, a projected serviceAccountToken source) -> a token
TokenSource = Callable[[Pod, Mapping[str, Any]], str]


def _object_files(
    lookup: ObjectLookup, kind: str, namespace: str, src: Mapping[str, Any], name: str
) -> dict[str, bytes]:
    data = lookup(kind, namespace, name)
    if data is None:
        if src.get("optional"):
            return {}
        raise SpecError("FailedMount", f'{kind} "{name}" not found')
    items = src.get("items")
    if not items:
        return {k: v.encode() for k, v in data.items()}
    out = {}
    for item in items:
        if item["key"] in data:
            out[str(item["path"])] = data[item["key"]].encode()
        elif not src.get("optional"):
            raise SpecError("FailedMount", f"key {item['key']} not found in {kind} {name}")
    return out


def _downward_files(pod: Pod, items: list[Mapping[str, Any]], facts: PodFacts) -> dict[str, bytes]:
    return {
        str(item["path"]): field_value(pod, str(item["fieldRef"]["fieldPath"]), facts).encode()
        for item in items
        if "fieldRef" in item
    }


def volume_files(
    pod: Pod, volume: Mapping[str, Any], facts: PodFacts, lookup: ObjectLookup, token: TokenSource
) -> dict[str, bytes]:
    """Relative path -> content for one volume (empty for emptyDir and unknown kinds)."""
    namespace = str((pod.get("metadata") or {}).get("namespace", ""))
    if "configMap" in volume:
        src = volume["configMap"]
        return _object_files(lookup, "configmap", namespace, src, str(src.get("name", "")))
    if "secret" in volume:
        src = volume["secret"]
        return _object_files(lookup, "secret", namespace, src, str(src.get("secretName", "")))
    if "downwardAPI" in volume:
        return _downward_files(pod, volume["downwardAPI"].get("items") or [], facts)
    out: dict[str, bytes] = {}
    for source in (volume.get("projected") or {}).get("sources") or []:
        for key, kind in (("configMap", "configmap"), ("secret", "secret")):
            if key in source:
                src = source[key]
                out.update(_object_files(lookup, kind, namespace, src, str(src.get("name", ""))))
        if "downwardAPI" in source:
            out.update(_downward_files(pod, source["downwardAPI"].get("items") or [], facts))
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            out[str(sat["path"])] = token(pod, sat).encode()
    return out


# ------------------------------------------------------------------------------ persistent volumes


def _claim_error(namespace: str, claim_name: str, why: str) -> SpecError:
    # The kubelet's volume manager words it so (pkg/kubelet/volumemanager/populator).
    return SpecError("FailedMount", f"error processing PVC {namespace}/{claim_name}: {why}")


def claim_volume_name(namespace: str, claim_name: str, claim: Mapping[str, Any] | None) -> str:
    """The PersistentVolume a claim is bound to (raises SpecError while there is none)."""
    if claim is None:
        raise _claim_error(
            namespace,
            claim_name,
            f'failed to fetch PVC from API server: persistentvolumeclaims "{claim_name}" not found',
        )
    if (claim.get("metadata") or {}).get("deletionTimestamp"):
        raise _claim_error(namespace, claim_name, "can't start pod because PVC is being deleted")
    phase = str((claim.get("status") or {}).get("phase") or "Pending")
    volume_name = str((claim.get("spec") or {}).get("volumeName") or "")
    if phase != "Bound" or not volume_name:
        raise _claim_error(
            namespace,
            claim_name,
            f'PVC {namespace}/{claim_name} has non-bound phase ("{phase}") or empty '
            f'pvc.Spec.VolumeName ("{volume_name}")',
        )
    return volume_name


def claim_path(namespace: str, claim: Mapping[str, Any], volume: Mapping[str, Any] | None) -> Path:
    """The local folder behind a bound claim: its PersistentVolume's hostPath or local path."""
    claim_meta = claim.get("metadata") or {}
    claim_name = str(claim_meta.get("name", ""))
    volume_name = str((claim.get("spec") or {}).get("volumeName") or "")
    if volume is None:
        raise _claim_error(
            namespace,
            claim_name,
            f'failed to fetch PV "{volume_name}" from API server: '
            f'persistentvolumes "{volume_name}" not found',
        )
    spec = volume.get("spec") or {}
    ref = spec.get("claimRef") or {}
    if ref.get("uid") not in (None, claim_meta.get("uid")) or ref.get("name") != claim_name:
        raise _claim_error(
            namespace, claim_name, f'PV "{volume_name}" is not bound to this claim (claimRef {dict(ref)})'
        )
    for kind in ("hostPath", "local"):
        path = (spec.get(kind) or {}).get("path")
        if path:
            return Path(str(path))
    kinds = sorted(k for k in spec if k not in _PV_COMMON_FIELDS)
    raise SpecError(
        "FailedMount",
        f'MountVolume.SetUp failed for volume "{volume_name}": the rankguard process kubelet mounts '
        f"only hostPath and local persistent volumes (this one is {', '.join(kinds) or 'of no kind'})",
    )


# PersistentVolumeSpec fields that are not a volume source.
_PV_COMMON_FIELDS = frozenset(
    {
        "accessModes",
        "capacity",
        "claimRef",
        "mountOptions",
        "nodeAffinity",
        "persistentVolumeReclaimPolicy",
        "storageClassName",
        "volumeAttributesClassName",
        "volumeMode",
    }
)
