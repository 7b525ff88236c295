"""The sandbox's storage, offline: how the process kubelet resolves a persistentVolumeClaim
volume, and what the local provisioner creates and deletes (tests/cluster/test_sim_storage.py
runs both against the real controller-manager)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rankguard_sim.kube import provisioner as prov
from rankguard_sim.kubelet.pod.spec import SpecError
from rankguard_sim.kubelet.pod.volumes import claim_path, claim_volume_name


def claim(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "metadata": {"name": "cache", "namespace": "ns1", "uid": "u-1", "resourceVersion": "7"},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": "200Gi"}},
            "storageClassName": prov.STORAGE_CLASS,
            "volumeName": "pvc-u-1",
        },
        "status": {"phase": "Bound"},
    }
    for key, value in over.items():
        section, _, field = key.partition("__")
        doc[section][field] = value
    return doc


def volume(path: str | None = "/vols/x", uid: str = "u-1") -> dict[str, Any]:
    spec: dict[str, Any] = {"claimRef": {"name": "cache", "namespace": "ns1", "uid": uid}, "capacity": {}}
    if path is not None:
        spec["hostPath"] = {"path": path}
    return {"metadata": {"name": "pvc-u-1"}, "spec": spec}


# ------------------------------------------------------------------------------ the kubelet side


def test_a_bound_claim_is_its_volumes_host_path() -> None:
    c = claim()
    assert claim_volume_name("ns1", "cache", c) == "pvc-u-1"
    assert claim_path("ns1", c, volume()) == Path("/vols/x")
    local = volume(None)
    local["spec"]["local"] = {"path": "/mnt/disks/ssd1"}
    assert claim_path("ns1", c, local) == Path("/mnt/disks/ssd1")


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        (None, 'failed to fetch PVC from API server: persistentvolumeclaims "cache" not found'),
        (claim(status__phase="Pending", spec__volumeName=""), 'has non-bound phase ("Pending")'),
        (claim(metadata__deletionTimestamp="2025-01-01T00:00:00Z"), "PVC is being deleted"),
    ],
)
def test_a_missing_unbound_or_deleted_claim_is_a_failed_mount(doc: dict[str, Any] | None, says: str) -> None:
    with pytest.raises(SpecError) as err:
        claim_volume_name("ns1", "cache", doc)
    assert err.value.reason == "FailedMount"
    assert err.value.message.startswith("error processing PVC ns1/cache: ")
    assert says in err.value.message


def test_a_volume_that_is_gone_someone_elses_or_not_a_folder_is_a_failed_mount() -> None:
    c = claim()
    for vol, says in (
        (None, 'persistentvolumes "pvc-u-1" not found'),
        (volume(uid="u-2"), "is not bound to this claim"),
        (
            {
                "metadata": {"name": "pvc-u-1"},
                "spec": {"claimRef": {"name": "cache", "uid": "u-1"}, "nfs": {}},
            },
            "nfs",
        ),
    ):
        with pytest.raises(SpecError, match=says) as err:
            claim_path("ns1", c, vol)
        assert err.value.reason == "FailedMount"


# ------------------------------------------------------------------------------ the provisioner


def test_the_storage_class_is_the_default_immediate_and_deletes() -> None:
    sc = prov.storage_class()
    assert sc["metadata"] == {
        "name": "rankguard-sim-local",
        "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
    }
    assert (sc["provisioner"], sc["volumeBindingMode"], sc["reclaimPolicy"]) == (
        "rankguard.io/sim-local",
        "Immediate",
        "Delete",
    )


def test_which_claims_are_provisioned() -> None:
    pending = claim(status__phase="Pending", spec__volumeName=None)
    assert prov.wants_volume(pending)
    other_class = claim(status__phase="Pending", spec__volumeName=None, spec__storageClassName="fast")
    assert not prov.wants_volume(other_class)
    # the PV controller's annotation names the provisioner (the class may be another's name for it)
    other_class["metadata"]["annotations"] = {"volume.kubernetes.io/storage-provisioner": prov.PROVISIONER}
    assert prov.wants_volume(other_class)
    assert not prov.wants_volume(claim())  # bound already
    assert not prov.wants_volume(
        claim(status__phase="Pending", metadata__deletionTimestamp="now", spec__volumeName=None)
    )
    assert prov.unsupported(pending) is None
    assert (
        prov.unsupported(claim(spec__selector={"matchLabels": {"a": "b"}}))
        == "claim Selector is not supported"
    )


def test_the_volume_is_a_host_path_pre_bound_to_its_claim(tmp_path: Path) -> None:
    c = claim(status__phase="Pending", spec__volumeName=None)
    pv = prov.persistent_volume(c, tmp_path / "pvc-u-1_ns1_cache")
    assert pv["metadata"] == {
        "name": "pvc-u-1",
        "annotations": {"pv.kubernetes.io/provisioned-by": prov.PROVISIONER},
    }
    spec = pv["spec"]
    assert spec["capacity"] == {"storage": "200Gi"}
    assert spec["accessModes"] == ["ReadWriteMany"] and spec["volumeMode"] == "Filesystem"
    assert spec["persistentVolumeReclaimPolicy"] == "Delete"
    assert spec["storageClassName"] == prov.STORAGE_CLASS
    assert spec["hostPath"] == {"path": str(tmp_path / "pvc-u-1_ns1_cache"), "type": "DirectoryOrCreate"}
    assert spec["claimRef"] == {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "namespace": "ns1",
        "name": "cache",
        "uid": "u-1",
        "resourceVersion": "7",
    }
    assert prov.folder_name(c) == "pvc-u-1_ns1_cache"


def test_only_its_own_released_delete_volumes_are_deleted() -> None:
    mine = {
        "metadata": {"name": "pvc-1", "annotations": {prov.PROVISIONED_BY: prov.PROVISIONER}},
        "spec": {"persistentVolumeReclaimPolicy": "Delete"},
        "status": {"phase": "Released"},
    }
    assert prov.deletable(mine)
    assert not prov.deletable({**mine, "status": {"phase": "Bound"}})
    assert not prov.deletable({**mine, "spec": {"persistentVolumeReclaimPolicy": "Retain"}})
    assert not prov.deletable({**mine, "metadata": {"name": "pvc-1", "annotations": {}}})
