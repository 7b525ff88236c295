"""The files a pod's volumes hold, from the pod spec and lookups (no I/O of its own).

emptyDir volumes are empty folders; configMap, secret, downwardAPI and projected volumes
(the service-account token volume every pod gets) are folders of files computed here;
hostPath volumes are the host path itself. The kubelet writes what `volume_files` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .podspec import ObjectLookup, Pod, PodFacts, SpecError, field_value

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
