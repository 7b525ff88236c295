"""A watched Deployment as its index keeps it (edge/handlers.serving_deployments), and whole again
for a pass (edge/executor).

Of a Deployment in memory its pod template's spec is two thirds (18 of 27 KiB as Python objects;
18 MiB at a thousand services, issue 31), yet a pass reads it only on the rare path that applies
the live Deployment back (core/step/scale_down, a Failed service scaled to zero; a server-side
apply needs the whole template). So the index keeps that spec as one compact JSON string and a
pass gets the object back as it was watched: the core sees no difference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

# where the packed pod spec sits in an index entry (not a Kubernetes field: never applied)
POD_SPEC_JSON = "rankguard.io/podSpecJSON"


def without_managed_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """A watched object without metadata.managedFields (nothing in the loop reads them)."""
    doc = {k: v for k, v in body.items() if k != "metadata"}
    doc["metadata"] = {k: v for k, v in dict(body.get("metadata") or {}).items() if k != "managedFields"}
    return doc


def packed_deployment(body: Mapping[str, Any]) -> dict[str, Any]:
    """The Deployment without managedFields, its pod template's spec as a JSON string."""
    doc = without_managed_fields(body)
    spec = dict(body.get("spec") or {})
    template = spec.get("template")
    if isinstance(template, Mapping) and "spec" in template:
        spec["template"] = {k: v for k, v in template.items() if k != "spec"}
        doc[POD_SPEC_JSON] = json.dumps(template["spec"], separators=(",", ":"))
    doc["spec"] = spec
    return doc


def unpacked_deployment(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The index entry as the Deployment it was (a new dict: the entry itself is left as kept)."""
    out = {k: v for k, v in doc.items() if k != POD_SPEC_JSON}
    raw = doc.get(POD_SPEC_JSON)
    if isinstance(raw, str):
        spec = dict(out.get("spec") or {})
        spec["template"] = {**dict(spec.get("template") or {}), "spec": json.loads(raw)}
        out["spec"] = spec
    return out
