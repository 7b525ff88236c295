"""The chart's values.schema.json takes whole Kubernetes objects (affinity, security contexts,
env, volumes, topology spread constraints, …) under definitions copied from Kubernetes' own
schema. This holds that copy to the real thing: the core group's OpenAPI v3 as the sandbox's
API server serves it. Every definition has exactly Kubernetes' fields, required keys, types,
references and enums, except where the chart narrows on purpose (named below), so a value
Kubernetes would take is never refused by the chart, and a typo is refused by both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rankguard_sim.kube.cluster import ControlPlane

pytestmark = pytest.mark.cluster

SCHEMA = Path(__file__).resolve().parents[2] / "charts" / "rankguard" / "values.schema.json"

# Where the chart narrows Kubernetes on purpose.
OURS = {"TemplateMetadata"}  # labels and annotations only, for a PVC template's metadata
NARROWED_REFS = {("PersistentVolumeClaimTemplate", "metadata"): "TemplateMetadata"}
# extraVolumes: only the volume types the "restricted" Pod Security Standard admits, so the
# chart's own default (restricted) holds whatever is added
NOT_RESTRICTED_VOLUMES = {
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "fc", "flexVolume",
    "flocker", "gcePersistentDisk", "gitRepo", "glusterfs", "hostPath", "image", "iscsi", "nfs",
    "photonPersistentDisk", "portworxVolume", "quobyte", "rbd", "scaleIO", "storageos",
    "vsphereVolume",
}  # fmt: skip


def _ref(schema: dict[str, Any]) -> str | None:
    ref = schema.get("$ref") or (schema.get("allOf") or [{}])[0].get("$ref")
    return str(ref).rsplit("/", 1)[-1].rsplit(".", 1)[-1] if ref else None


def differences(ours: dict[str, Any], live: dict[str, Any]) -> list[str]:
    """How the chart's definitions differ from the live schemas (by short name)."""
    by_short = {full.rsplit(".", 1)[-1]: s for full, s in live.items()}
    out = []
    for name, mine in sorted(ours.items()):
        if name in OURS:
            continue
        theirs = by_short.get(name)
        if theirs is None:
            out.append(f"{name}: no such Kubernetes schema")
            continue
        fields, known = set(mine.get("properties", {})), set(theirs.get("properties", {}))
        left_out = known - fields - (NOT_RESTRICTED_VOLUMES if name == "Volume" else set())
        if left_out or fields - known:
            out.append(f"{name}: missing {sorted(left_out)}, unknown to Kubernetes {sorted(fields - known)}")
        if name == "Volume" and fields & NOT_RESTRICTED_VOLUMES:
            out.append(
                f"Volume: admits {sorted(fields & NOT_RESTRICTED_VOLUMES)}, which restricted pods may not use"
            )
        if set(mine.get("required", [])) != set(theirs.get("required", [])):
            out.append(f"{name}: required {mine.get('required')} vs {theirs.get('required')}")
        for field in sorted(fields & known):
            m, t = mine["properties"][field], theirs["properties"][field]
            want = NARROWED_REFS.get((name, field)) or _ref(t)
            if want in ("Quantity", "IntOrString"):
                want = "Quantity" if want == "Quantity" else None
            got = _ref(m)
            if want != got and not (want is None and got is None):
                out.append(f"{name}.{field}: refers to {got}, Kubernetes to {want}")
            if want is None and m.get("type") != t.get("type"):
                out.append(f"{name}.{field}: type {m.get('type')} vs {t.get('type')}")
            for key in ("items", "additionalProperties"):
                if isinstance(t.get(key), dict) and _ref(t[key]) != _ref(m.get(key) or {}):
                    out.append(f"{name}.{field}: {key} refer to {_ref(m.get(key) or {})} vs {_ref(t[key])}")
            if m.get("enum") != t.get("enum"):
                out.append(f"{name}.{field}: enum {m.get('enum')} vs {t.get('enum')}")
    return out


@pytest.fixture(scope="module")
def live(cluster: ControlPlane) -> dict[str, Any]:
    doc = json.loads(cluster.kubectl("get", "--raw", "/openapi/v3/api/v1", timeout=120).stdout)
    schemas: dict[str, Any] = doc["components"]["schemas"]
    return schemas


def test_the_charts_kubernetes_definitions_are_kubernetes_own(live: dict[str, Any]) -> None:
    ours = json.loads(SCHEMA.read_text())["definitions"]
    assert len(ours) > 40  # the definitions the chart's values refer to
    assert differences(ours, live) == []


def test_a_definition_that_drifted_is_caught(live: dict[str, Any]) -> None:
    ours = json.loads(SCHEMA.read_text())["definitions"]
    ours["VolumeMount"]["properties"].pop("subPathExpr")
    ours["VolumeMount"]["properties"]["mountPath"] = {"type": "integer"}
    ours["SeccompProfile"]["properties"]["type"].pop("enum")
    ours["Volume"]["properties"]["hostPath"] = {"type": "object"}
    found = differences(ours, live)
    assert any("VolumeMount: missing ['subPathExpr']" in d for d in found), found
    assert "VolumeMount.mountPath: type integer vs string" in found
    assert any(d.startswith("SeccompProfile.type: enum None vs") for d in found), found
    assert "Volume: admits ['hostPath'], which restricted pods may not use" in found
