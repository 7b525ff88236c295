"""What the CRD tests share: an LLMService document, `kubectl apply` of it, and the check that a
spec is refused twice, by the API server at apply time (CEL, schema) and by the operator's parser
(which may run against an older CRD), each with its own words."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_sim.kube.cluster import ControlPlane
from tests import builders


def llmservice(name: str, model: str, **spec: Any) -> dict[str, Any]:
    return builders.llmservice(name, {"model": {"name": model}, "image": "vllm/vllm-openai:v0.33.0", **spec})


def apply(cluster: ControlPlane, namespace: str, obj: dict[str, Any]) -> Any:
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False)


def assert_refused_twice(
    cluster: ControlPlane, namespace: str, obj: dict[str, Any], server_says: str, operator_says: str
) -> None:
    r = apply(cluster, namespace, obj)
    assert r.returncode != 0, f"{obj['metadata']['name']} was accepted"
    # kubectl folds the message at 80 columns or not, by version: compare words, not breaks
    assert " ".join(server_says.split()) in " ".join(r.stderr.split()), r.stderr
    with pytest.raises(SpecError) as exc:
        parse_spec(obj["spec"])
    assert operator_says in str(exc.value)
