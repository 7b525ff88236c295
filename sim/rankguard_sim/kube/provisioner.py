"""The sandbox's storage: a default StorageClass and a local-path provisioner for it.

Like kind's local-path-provisioner, it turns PersistentVolumeClaims into folders on this
machine. `LocalProvisioner(api, root).start()` creates the StorageClass `rankguard-sim-local`
(provisioner `rankguard.io/sim-local`, volumeBindingMode Immediate, reclaimPolicy Delete,
marked default with `storageclass.kubernetes.io/is-default-class`, so the API server's
DefaultStorageClass admission gives it to every claim that names no class) and runs one
thread that plays the external provisioner's half of the real protocol:

* Provision. The controller-manager's PV controller (persistentvolume-binder) sees a
  Pending claim of a class whose provisioner is not in-tree, annotates the claim with
  `volume.kubernetes.io/storage-provisioner` and waits. For each such claim naming this
  provisioner (or, before that annotation, this class) the thread creates a folder
  `<root>/pvc-<uid>_<namespace>_<name>` and a hostPath PersistentVolume `pvc-<claim uid>`
  for it: capacity = the claim's storage request, accessModes and volumeMode = the claim's,
  reclaimPolicy = the class's, `claimRef` = the claim (with its uid), annotation
  `pv.kubernetes.io/provisioned-by`. The PV controller then binds the two (claim Bound,
  `spec.volumeName` set), as on a real cluster; the process kubelet mounts the folder.
* Delete. After its claim is deleted the PV controller marks the PV Released; an externally
  provisioned PV is left to its provisioner (the controller-manager deletes only volumes of
  in-tree plugins), so for a Released PV of this provisioner with reclaimPolicy Delete the
  thread removes the folder and deletes the PV. Retain keeps both.

It works in levels, not events: every `interval` seconds it lists claims and volumes and does
whatever is missing (a watch would do the same work a little sooner). Claims with a
`selector` or a `dataSource` are not provisioned (logged), as the external provisioner
library refuses them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_sim.kube.api import Throttled, raw_call

log = logging.getLogger("rankguard_sim.provisioner")

STORAGE_CLASS = "rankguard-sim-local"
PROVISIONER = "rankguard.io/sim-local"
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
# Set on a claim by the PV controller: which (external) provisioner is to provision it.
PROVISIONER_ANNOTATIONS = (
    "volume.kubernetes.io/storage-provisioner",
    "volume.beta.kubernetes.io/storage-provisioner",
)
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"


def storage_class(name: str = STORAGE_CLASS, *, default: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": name,
            "annotations": {DEFAULT_CLASS_ANNOTATION: "true" if default else "false"},
        },
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def volume_name(claim: Mapping[str, Any]) -> str:
    """The PV's name for a claim, as the external provisioner names it."""
    return f"pvc-{(claim.get('metadata') or {}).get('uid', '')}"


def folder_name(claim: Mapping[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    raw = f"{volume_name(claim)}_{meta.get('namespace', '')}_{meta.get('name', '')}"
    return re.sub(r"[^A-Za-z0-9_.-]", "-", raw)


def wants_volume(claim: Mapping[str, Any], class_name: str = STORAGE_CLASS) -> bool:
    """A claim this provisioner should provision: Pending, unbound, not being deleted, and of
    this provisioner (the PV controller's annotation) or of this class."""
    meta, spec = claim.get("metadata") or {}, claim.get("spec") or {}
    if meta.get("deletionTimestamp") or spec.get("volumeName"):
        return False
    if str((claim.get("status") or {}).get("phase") or "Pending") != "Pending":
        return False
    annotations = meta.get("annotations") or {}
    named = any(annotations.get(a) == PROVISIONER for a in PROVISIONER_ANNOTATIONS)
    return named or spec.get("storageClassName") == class_name


def unsupported(claim: Mapping[str, Any]) -> str | None:
    """Why a claim cannot be provisioned here, or None."""
    spec = claim.get("spec") or {}
    if spec.get("selector"):
        return "claim Selector is not supported"
    if spec.get("dataSource") or spec.get("dataSourceRef"):
        return "claim dataSource is not supported"
    if not ((spec.get("resources") or {}).get("requests") or {}).get("storage"):
        return "claim has no storage request"
    return None


def persistent_volume(
    claim: Mapping[str, Any], path: Path, *, reclaim_policy: str = "Delete"
) -> dict[str, Any]:
    """The hostPath PersistentVolume provisioned for `claim`, pre-bound to it by claimRef."""
    meta, spec = claim.get("metadata") or {}, claim.get("spec") or {}
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": volume_name(claim), "annotations": {PROVISIONED_BY: PROVISIONER}},
        "spec": {
            "capacity": {"storage": str(spec["resources"]["requests"]["storage"])},
            "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
            "volumeMode": str(spec.get("volumeMode") or "Filesystem"),
            "persistentVolumeReclaimPolicy": reclaim_policy,
            "storageClassName": str(spec.get("storageClassName") or STORAGE_CLASS),
            "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta.get("namespace"),
                "name": meta.get("name"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
        },
    }


def deletable(volume: Mapping[str, Any]) -> bool:
    """A volume this provisioner made whose claim is gone and whose policy is Delete."""
    meta, spec = volume.get("metadata") or {}, volume.get("spec") or {}
    return (
        (meta.get("annotations") or {}).get(PROVISIONED_BY) == PROVISIONER
        and not meta.get("deletionTimestamp")
        and (volume.get("status") or {}).get("phase") == "Released"
        and spec.get("persistentVolumeReclaimPolicy") == "Delete"
    )


class LocalProvisioner:
    """The StorageClass and its provisioning thread. `start()` returns at once; `stop()` joins."""

    def __init__(
        self,
        api_client: client.ApiClient,
        root: Path,
        *,
        class_name: str = STORAGE_CLASS,
        default: bool = True,
        interval: float = 0.5,
    ) -> None:
        self.root = Path(root).absolute()
        self.class_name = class_name
        self.default = default
        self.interval = interval
        # Our own client over the caller's configuration, closed by stop().
        self._api = client.ApiClient(copy.deepcopy(api_client.configuration))
        self.core = client.CoreV1Api(self._api)
        self.storage = client.StorageV1Api(self._api)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._throttle = Throttled()
        self._refused: set[str] = set()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("this LocalProvisioner was already started")
        self.root.mkdir(parents=True, exist_ok=True)
        self.ensure_storage_class()
        self._thread = threading.Thread(target=self._run, name="sim-local-provisioner", daemon=True)
        self._thread.start()
        log.info("provisioner %s: StorageClass %s, volumes under %s", PROVISIONER, self.class_name, self.root)

    def stop(self) -> None:
        """Stop the thread (volumes and their folders stay: the cluster may outlive it). Idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._api.close()

    def __enter__(self) -> LocalProvisioner:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def ensure_storage_class(self) -> None:
        body = storage_class(self.class_name, default=self.default)
        try:
            self.storage.create_storage_class(body)
        except ApiException as e:
            if e.status != 409:
                raise
            # A class of that name exists (a reused cluster): parameters are immutable, the
            # default marker is not.
            self.storage.patch_storage_class(
                self.class_name, {"metadata": {"annotations": body["metadata"]["annotations"]}}
            )

    # -- the loop ------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.sync()
            except Exception as e:  # the API server may be restarting: next round
                self._throttle.warn("provisioner: sync failed (%s); retrying", e)
            self._stopping.wait(self.interval)

    def sync(self) -> None:
        """One pass: provision what is wanted, delete what is released."""
        claims = raw_call(self.core.list_persistent_volume_claim_for_all_namespaces).get("items") or []
        volumes = raw_call(self.core.list_persistent_volume).get("items") or []
        existing = {str((v.get("metadata") or {}).get("name")) for v in volumes}
        wanted = [c for c in claims if wants_volume(c, self.class_name) and volume_name(c) not in existing]
        reclaim = self._reclaim_policy() if wanted else "Delete"
        for claim in wanted:
            self._provision(claim, reclaim)
        for volume in volumes:
            if deletable(volume):
                self._delete(volume)

    def _reclaim_policy(self) -> str:
        doc = raw_call(self.storage.read_storage_class, self.class_name)
        return str(doc.get("reclaimPolicy") or "Delete")

    def _provision(self, claim: Mapping[str, Any], reclaim: str) -> None:
        meta = claim.get("metadata") or {}
        key = f"{meta.get('namespace')}/{meta.get('name')}"
        why = unsupported(claim)
        if why is not None:
            if str(meta.get("uid")) not in self._refused:
                self._refused.add(str(meta.get("uid")))
                log.warning("provisioner: claim %s not provisioned: %s", key, why)
            return
        path = self.root / folder_name(claim)
        path.mkdir(parents=True, exist_ok=True)
        try:
            self.core.create_persistent_volume(persistent_volume(claim, path, reclaim_policy=reclaim))
        except ApiException as e:
            if e.status != 409:
                raise
            return
        log.info("provisioner: claim %s -> volume %s at %s", key, volume_name(claim), path)

    def _delete(self, volume: Mapping[str, Any]) -> None:
        meta, spec = volume.get("metadata") or {}, volume.get("spec") or {}
        path = Path(str((spec.get("hostPath") or {}).get("path") or ""))
        # Only ever a folder this provisioner made: directly under its root.
        if path.parent == self.root and path.name.startswith("pvc-"):
            shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(ApiException):
            self.core.delete_persistent_volume(str(meta.get("name")))
        log.info("provisioner: volume %s released and deleted", meta.get("name"))
