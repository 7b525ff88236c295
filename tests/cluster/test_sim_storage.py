"""The sandbox's storage on the real control plane: the default StorageClass, the local
provisioner, the controller-manager's PV controller binding, and the process kubelet mounting
the volume's folder into pods (shared across pods, waiting while a claim is missing)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.kube.provisioner import PROVISIONED_BY, PROVISIONER, STORAGE_CLASS
from rankguard_sim.kubelet.kubelet import ProcessKubelet
from rankguard_sim.waiting import wait_for
from rankguard_sim.world import running

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def node(api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessKubelet]:
    root = tmp_path_factory.mktemp("storage-node")
    name = f"st-{uuid.uuid4().hex[:6]}"
    kubelet = ProcessKubelet(
        api, name, workdir=root / "kubelet", gpu_root=root / "gpus", gpus=1, delete_node_on_stop=True
    )
    with running(api, kubelet):
        yield kubelet


def raw(call: Any, *args: Any) -> dict[str, Any]:
    resp = call(*args, _preload_content=False)
    return dict(json.loads(resp.data))


def claim_body(
    name: str, storage: str = "1Gi", modes: tuple[str, ...] = ("ReadWriteMany",)
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        # no storageClassName: the API server's DefaultStorageClass admission gives the default
        "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": storage}}},
    }


def file_pod(name: str, node: str | None, code: str, claim: str, *, bind: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "main",
                "image": "python:3.11",
                "command": ["python3", "-c", code, "/data/hello.txt"],
                "volumeMounts": [{"name": "cache", "mountPath": "/data"}],
            }
        ],
        "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": claim}}],
    }
    if bind:
        spec["nodeName"] = node  # straight onto the node: no scheduler waiting for the claim
    else:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


WRITE = "import sys; open(sys.argv[1], 'w').write('written by the first pod')"
READ = "import sys; sys.exit(0 if open(sys.argv[1]).read() == 'written by the first pod' else 3)"


def phase(core: client.CoreV1Api, ns: str, name: str) -> str:
    return str((raw(core.read_namespaced_pod, name, ns).get("status") or {}).get("phase", ""))


def test_the_sandbox_has_a_default_local_storage_class(api: client.ApiClient, cluster: ControlPlane) -> None:
    sc = raw(client.StorageV1Api(api).read_storage_class, STORAGE_CLASS)
    assert sc["provisioner"] == PROVISIONER
    assert sc["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"] == "true"
    assert (sc["volumeBindingMode"], sc["reclaimPolicy"]) == ("Immediate", "Delete")
    assert cluster.provisioner is not None


def test_a_claim_is_provisioned_bound_and_shared_by_pods_then_deleted_with_its_folder(
    api: client.ApiClient, namespace: str, node: ProcessKubelet, cluster: ControlPlane
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_persistent_volume_claim(namespace, claim_body("cache", "5Gi"))

    def bound() -> dict[str, Any] | None:
        doc = raw(core.read_namespaced_persistent_volume_claim, "cache", namespace)
        return doc if (doc.get("status") or {}).get("phase") == "Bound" else None

    pvc = wait_for("the controller-manager to bind the claim", bound, timeout=60)
    assert pvc["spec"]["storageClassName"] == STORAGE_CLASS  # the default, by admission
    assert pvc["metadata"]["annotations"]["volume.kubernetes.io/storage-provisioner"] == PROVISIONER
    pv = raw(core.read_persistent_volume, pvc["spec"]["volumeName"])
    assert pv["metadata"]["name"] == f"pvc-{pvc['metadata']['uid']}"
    assert pv["metadata"]["annotations"][PROVISIONED_BY] == PROVISIONER
    assert pv["spec"]["capacity"]["storage"] == "5Gi" and pv["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pv["spec"]["claimRef"]["uid"] == pvc["metadata"]["uid"]
    folder = Path(pv["spec"]["hostPath"]["path"])
    assert folder.parent == cluster.volumes_dir.absolute() and folder.is_dir()

    core.create_namespaced_pod(namespace, file_pod("writer", node.node_name, WRITE, "cache"))
    wait_for("the writer to succeed", lambda: phase(core, namespace, "writer") == "Succeeded", timeout=60)
    assert (folder / "hello.txt").read_text() == "written by the first pod"
    core.create_namespaced_pod(namespace, file_pod("reader", node.node_name, READ, "cache"))
    wait_for("the reader to succeed", lambda: phase(core, namespace, "reader") == "Succeeded", timeout=60)

    for pod in ("writer", "reader"):
        core.delete_namespaced_pod(pod, namespace)
    core.delete_namespaced_persistent_volume_claim("cache", namespace)

    def volume_gone() -> bool:
        try:
            core.read_persistent_volume(pv["metadata"]["name"])
        except ApiException as e:
            return bool(e.status == 404)
        return False

    wait_for("the released volume to be deleted", volume_gone, timeout=90)
    assert not folder.exists()


def test_a_pod_waits_for_its_claim_then_mounts_it(
    api: client.ApiClient, namespace: str, node: ProcessKubelet
) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, file_pod("early", node.node_name, WRITE, "later", bind=True))

    def failed_mount() -> str | None:
        # as the real kubelet: the reason is a Warning Event on the pod, the container only waits
        found = core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=early,reason=FailedMount,type=Warning"
        ).items
        return str(found[0].message) if found else None

    message = wait_for("the kubelet to report the missing claim", failed_mount, timeout=30)
    assert message.startswith('MountVolume.SetUp failed for volume "')
    assert "error processing PVC" in message and 'persistentvolumeclaims "later" not found' in message
    statuses = (raw(core.read_namespaced_pod, "early", namespace).get("status") or {}).get(
        "containerStatuses"
    ) or [{}]
    waiting = (statuses[0].get("state") or {}).get("waiting") or {}
    assert waiting.get("reason") == "ContainerCreating" and not waiting.get("message"), waiting
    assert phase(core, namespace, "early") == "Pending"

    core.create_namespaced_persistent_volume_claim(namespace, claim_body("later", modes=("ReadWriteOnce",)))
    wait_for(
        "the pod to run once its claim is bound", lambda: phase(core, namespace, "early") == "Succeeded", 60
    )
