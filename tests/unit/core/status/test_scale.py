"""core/status/scale: the fields the CRD's scale subresource reads, and the spec key that tells a
scale from an edit. The step's use of them is tests/unit/core/step/test_reconcile_scale.py."""

from __future__ import annotations

import yaml

from rankguard_operator.core.names import ROLE_LABEL, label_value
from rankguard_operator.core.status.scale import as_of_scale, scale_status, scaled_only, spec_key
from tests import REPO

CRD = yaml.safe_load((REPO / "crds" / "llmservice.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
STATUS = VERSION["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]


def test_the_crd_scale_subresource_reads_the_fields_written() -> None:
    assert VERSION["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    written = scale_status("svc", multi_node=False, workload=None)
    assert set(written) == {"replicas", "selector"}
    assert STATUS["replicas"]["type"] == "integer" and STATUS["selector"]["type"] == "string"
    assert len(written["selector"]) <= STATUS["selector"]["maxLength"]
    assert STATUS["specKey"]["type"] == "string" and len(spec_key({})) <= STATUS["specKey"]["maxLength"]


def test_replicas_are_the_workloads_and_the_selector_its_serving_pods() -> None:
    one = scale_status("svc", multi_node=False, workload={"status": {"replicas": 3, "readyReplicas": 1}})
    assert one == {"replicas": 3, "selector": "app.kubernetes.io/name=vllm,rankguard.io/llmservice=svc"}
    groups = scale_status("svc", multi_node=True, workload={"status": {"replicas": 2}})
    assert groups["selector"] == f"{one['selector']},{ROLE_LABEL}=leader"
    assert scale_status("svc", multi_node=False, workload={"status": {}})["replicas"] == 0
    assert scale_status("svc", multi_node=False, workload={"status": {"replicas": True}})["replicas"] == 0
    long = "a" * 200  # a label value is at most 63 characters: the selector names the label's value
    assert scale_status(long, multi_node=False, workload=None)["selector"].endswith(label_value(long))


def test_a_new_generation_is_a_scale_only_when_the_rest_of_the_spec_is_the_same() -> None:
    spec = {"model": {"name": "m"}, "replicas": 1}
    old = {"observedGeneration": 1, "specKey": spec_key(spec)}
    assert scaled_only(old, 2, {**spec, "replicas": 3})
    assert not scaled_only(old, 2, {**spec, "model": {"name": "other"}})
    assert not scaled_only(old, 1, {**spec, "replicas": 3})  # the same generation: nothing new
    assert not scaled_only({"observedGeneration": 1}, 2, spec)  # written before specKey: an edit


def test_after_a_scale_the_conditions_of_the_last_generation_carry_over() -> None:
    old = {
        "observedGeneration": 4,
        "conditions": [
            {"type": "Degraded", "reason": "OOMAtFloor", "observedGeneration": 4},
            {"type": "Ready", "observedGeneration": 3},
        ],
    }
    carried = as_of_scale(old, 5)
    assert [c["observedGeneration"] for c in carried["conditions"]] == [5, 3]
    assert old["conditions"][0]["observedGeneration"] == 4  # a copy
