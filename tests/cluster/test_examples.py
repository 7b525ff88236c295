"""Every file in examples/ against a real kube-apiserver with the LLMService CRD installed: each
is accepted by `kubectl apply --dry-run=server` (the CRD's OpenAPI schema, its CEL rules and
strict field validation, exactly as on a cluster), the documented way to apply the H100 example
without its placeholder Secret sends only the LLMService, and an example that sets what rankguard
owns on the vllm container is refused with a message naming the field.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rankguard_sim.kube.cluster import ControlPlane
from tests.cluster.example_files import documents, dry_run_lines

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
H100 = REPO / "examples" / "llama-3.3-70b-tp4-h100.yaml"
# The selector docs/install.md and the H100 example give to apply the LLMService without the
# placeholder Secret.
WITHOUT_PLACEHOLDER = "rankguard.io/example-placeholder!=true"


def dry_run(cluster: ControlPlane, namespace: str, *args: str, input: str | None = None) -> Any:
    return cluster.kubectl("apply", "--dry-run=server", "-n", namespace, *args, input=input, check=False)


def test_the_real_cluster_examples_are_there() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"llama3-70b-tp4.yaml", "llama-3.3-70b-tp4-h100.yaml", "mig.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_api_server(
    cluster: ControlPlane, crd: str, namespace: str, path: Path
) -> None:
    r = dry_run(cluster, namespace, "-f", str(path))
    assert r.returncode == 0, r.stderr
    # one "<kind>[.<group>]/<name> created (server dry run)" line per object in the file
    for line in dry_run_lines(path, "created"):
        assert line in r.stdout, r.stdout


def test_h100_example_without_the_placeholder_secret_sends_only_the_llmservice(
    cluster: ControlPlane, crd: str, namespace: str
) -> None:
    r = dry_run(cluster, namespace, "-f", str(H100), "-l", WITHOUT_PLACEHOLDER)
    assert r.returncode == 0, r.stderr
    assert "llmservice.rankguard.io/llama-3-3-70b created (server dry run)" in r.stdout
    assert "secret" not in r.stdout.lower(), r.stdout


def test_image_on_the_vllm_container_is_refused_with_the_field_named(
    cluster: ControlPlane, crd: str, namespace: str
) -> None:
    [svc] = [copy.deepcopy(d) for d in documents(H100) if d["kind"] == "LLMService"]
    [vllm] = [c for c in svc["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    vllm["image"] = "vllm/vllm-openai:latest"
    r = dry_run(cluster, namespace, "-f", "-", input=json.dumps(svc))
    assert r.returncode != 0, r.stdout
    assert "template.spec.containers[vllm] cannot set image" in r.stderr, r.stderr
    assert "the image is spec.image" in r.stderr, r.stderr
