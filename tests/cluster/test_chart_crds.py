"""The LLMService CRD as a chart template: one source, switchable, upgraded, kept.

- the CRD the chart renders is crds/llmservice.yaml: the spec byte for byte, the name and the
  file's labels, plus the chart's labels and (crds.keep) the keep annotation; crds.install
  turns it off; a copy that drifted is caught; the packaged chart carries the file itself.
- on a control plane of this module's own (these tests delete the CRD, which every other
  cluster test needs): a release installs the CRD, upgrades it and keeps it on uninstall; a
  CRD it does not own (applied with kubectl, as older charts and people did) is left alone
  until adopted as docs/install.md says; crds.keep=false lets uninstall delete it.

Helpers (render, run_helm, by_kind) are test_chart.py's.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_chart import CHART, CRD_NAME, REPO, by_kind, render, run_helm, template, unexpected_stderr

from rankguard_sim.kube.cluster import ControlPlane

pytestmark = pytest.mark.cluster

SOURCE = REPO / "crds" / "llmservice.yaml"
KEEP = {"helm.sh/resource-policy": "keep"}


def after_spec_line(text: str) -> str:
    """The text after the top-level `spec:` line: the CRD's whole spec, as written (the final
    newline aside, which Helm's document separator takes)."""
    parts = re.split(r"(?m)^spec:[ \t]*$", text)
    assert len(parts) == 2, "one top-level spec: line"
    return parts[1].rstrip("\n")


def rendered_crd_text(chart: Path, *values: str) -> str:
    """The CRD document of `helm template`, as text ("" when the chart renders none)."""
    r = template("-n", "ops", *values, chart=chart)
    assert unexpected_stderr(r.stderr) == [], r.stderr
    docs = [d for d in r.stdout.split("\n---\n") if "\nkind: CustomResourceDefinition\n" in d]
    assert len(docs) <= 1
    return docs[0] if docs else ""


def crd_drift(chart: Path) -> list[str]:
    """How the CRD `chart` renders differs from crds/llmservice.yaml; [] when it is the same."""
    source_text = SOURCE.read_text()
    source = yaml.safe_load(source_text)
    text = rendered_crd_text(chart)
    if not text:
        return ["the chart renders no CRD"]
    crd = yaml.safe_load(text)
    drift = []
    if after_spec_line(text) != after_spec_line(source_text):
        drift.append("the spec is not crds/llmservice.yaml's text")
    if crd["spec"] != source["spec"]:
        drift.append("the spec is not crds/llmservice.yaml's")
    for key in ("apiVersion", "kind"):
        if crd[key] != source[key]:
            drift.append(f"{key}: {crd[key]} != {source[key]}")
    if crd["metadata"]["name"] != source["metadata"]["name"]:
        drift.append("another name")
    if not source["metadata"].get("labels", {}).items() <= crd["metadata"]["labels"].items():
        drift.append("the file's labels are missing")
    return drift


# --------------------------------------------------------------------------- helm only
def test_the_chart_renders_crds_llmservice_yaml_with_its_own_metadata() -> None:
    assert crd_drift(CHART) == []
    (crd,) = by_kind(render("ops"), "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == KEEP
    labels = crd["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == "rg"
    assert labels["app.kubernetes.io/component"] == "crd"  # never matched by the operator's selector
    (crd,) = by_kind(render("ops", "--set", "crds.keep=false"), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]
    assert by_kind(render("ops", "--set", "crds.install=false"), "CustomResourceDefinition") == []
    # Helm's crds/ folder is empty: nothing is installed behind crds.install's back.
    assert run_helm("show", "crds", str(CHART)).stdout.strip() == ""


def test_the_drift_check_catches_a_copy_that_differs(tmp_path: Path) -> None:
    copy = tmp_path / "rankguard"
    shutil.copytree(CHART, copy, symlinks=False)  # the link becomes a plain copy of the file
    source = copy / "crd-source" / "llmservice.yaml"
    assert not source.is_symlink()
    assert crd_drift(copy) == []
    text = source.read_text()
    source.write_text(text.replace("description: The model being served.", "description: Drifted.", 1))
    assert crd_drift(copy) == [
        "the spec is not crds/llmservice.yaml's text",
        "the spec is not crds/llmservice.yaml's",
    ]


def test_the_packaged_chart_carries_the_crd_file_itself(tmp_path: Path) -> None:
    run_helm("package", str(CHART), "-d", str(tmp_path))
    (archive,) = tmp_path.glob("rankguard-*.tgz")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        member = tar.getmember("rankguard/crd-source/llmservice.yaml")
        assert member.isfile()  # not a link a user's machine cannot resolve
        extracted = tar.extractfile(member)
        assert extracted is not None
        assert extracted.read() == SOURCE.read_bytes()
    assert not [n for n in names if n.startswith("rankguard/crds/")]
    assert crd_drift(archive) == []


# --------------------------------------------------------------------------- a cluster of its own
@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane.start(tmp_path_factory.mktemp("crd-control-plane"), storage=False)
    try:
        yield cp
    finally:
        cp.stop()


def get_crd(cp: ControlPlane) -> dict[str, Any] | None:
    r = cp.kubectl("get", "crd", CRD_NAME, "-o", "json", "--ignore-not-found")
    return json.loads(r.stdout) if r.stdout.strip() else None


def no_crd(cp: ControlPlane) -> None:
    """Start from a cluster without the CRD (kubectl waits until it is gone)."""
    cp.kubectl("delete", "crd", CRD_NAME, "--ignore-not-found", "--wait=true", "--timeout=60s")
    assert get_crd(cp) is None


def helm_ok(cp: ControlPlane, *args: str) -> str:
    r = cp.helm(*args, check=False)
    assert r.returncode == 0, r.stderr
    assert unexpected_stderr(r.stderr) == [], r.stderr
    return r.stdout


def install(cp: ControlPlane, release: str, *values: str) -> str:
    """`helm install` into a namespace named after the release; returns that namespace."""
    helm_ok(cp, "install", release, str(CHART), "-n", f"ns-{release}", "--create-namespace", *values)
    return f"ns-{release}"


def uninstall(cp: ControlPlane, release: str) -> str:
    return helm_ok(cp, "uninstall", release, "-n", f"ns-{release}", "--wait", "--timeout=60s")


def owner(crd: dict[str, Any]) -> tuple[str | None, str | None]:
    annotations = crd["metadata"].get("annotations", {})
    return annotations.get("meta.helm.sh/release-name"), annotations.get("meta.helm.sh/release-namespace")


def test_a_release_installs_upgrades_and_keeps_the_crd(own_cluster: ControlPlane) -> None:
    cp = own_cluster
    no_crd(cp)
    ns = install(cp, "rga")
    try:
        crd = get_crd(cp)
        assert crd is not None
        assert owner(crd) == ("rga", ns)
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert crd["spec"]["versions"] == yaml.safe_load(SOURCE.read_text())["spec"]["versions"]
        # `helm upgrade` upgrades the CRD (Helm never upgrades what crds/ installed).
        helm_ok(
            cp, "upgrade", "rga", str(CHART), "-n", ns, "--reuse-values", "--set", "commonLabels.upgraded=yes"
        )
        crd = get_crd(cp)
        assert crd is not None and crd["metadata"]["labels"]["upgraded"] == "yes"
    finally:
        out = uninstall(cp, "rga")
    assert f"kept due to the resource policy:\n[CustomResourceDefinition] {CRD_NAME}" in out
    crd = get_crd(cp)
    assert crd is not None and crd["metadata"].get("deletionTimestamp") is None


def adoption_commands(release: str, namespace: str) -> list[list[str]]:
    """docs/install.md's commands that hand a CRD applied with kubectl over to a release."""
    text = (REPO / "docs" / "install.md").read_text()
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip().startswith(("kubectl label crd", "kubectl annotate crd"))
    ]
    assert len(lines) == 2, lines
    swapped = [
        line.replace("release-name=rankguard ", f"release-name={release} ").replace(
            "rankguard-system", namespace
        )
        for line in lines
    ]
    return [shlex.split(line)[1:] for line in swapped]


def test_a_crd_the_release_does_not_own_is_left_alone_until_adopted(own_cluster: ControlPlane) -> None:
    cp = own_cluster
    no_crd(cp)
    cp.kubectl("apply", "--server-side", "--field-manager=someone", "-f", str(SOURCE))
    ns = install(cp, "rgb")
    try:
        crd = get_crd(cp)
        assert crd is not None and owner(crd) == (None, None)  # untouched
        manifest = helm_ok(cp, "get", "manifest", "rgb", "-n", ns)
        assert "kind: CustomResourceDefinition" not in manifest
        notes = helm_ok(cp, "get", "notes", "rgb", "-n", ns)
        assert "this release does not own it" in notes and "crds/llmservice.yaml" in notes
        # Adopted as docs/install.md says, the next upgrade takes the CRD over.
        for command in adoption_commands("rgb", ns):
            cp.kubectl(*command)
        helm_ok(cp, "upgrade", "rgb", str(CHART), "-n", ns, "--reuse-values")
        assert "kind: CustomResourceDefinition" in helm_ok(cp, "get", "manifest", "rgb", "-n", ns)
        crd = get_crd(cp)
        assert crd is not None and owner(crd) == ("rgb", ns)
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    finally:
        uninstall(cp, "rgb")
    assert get_crd(cp) is not None


def test_crds_keep_false_lets_uninstall_delete_the_crd(own_cluster: ControlPlane) -> None:
    cp = own_cluster
    no_crd(cp)
    install(cp, "rgc", "--set", "crds.keep=false")
    crd = get_crd(cp)
    assert crd is not None and "helm.sh/resource-policy" not in crd["metadata"]["annotations"]
    uninstall(cp, "rgc")
    assert get_crd(cp) is None


def test_crds_install_false_installs_no_crd(own_cluster: ControlPlane) -> None:
    cp = own_cluster
    no_crd(cp)
    ns = install(cp, "rgd", "--set", "crds.install=false")
    try:
        assert get_crd(cp) is None
        assert "crds.install=false" in helm_ok(cp, "get", "notes", "rgd", "-n", ns)
    finally:
        uninstall(cp, "rgd")
