"""Mount paths and per-GPU byte figures on a real kube-apiserver (issue 30): what the CRD's CEL
rules refuse at `kubectl apply` (a mount at or under /dev, /proc or /sys, a `..` component, a
byte figure above 1 TiB), what only the operator can refuse (another spelling of a reserved
path: `/opt/rankguard/./agent`), and that the operator's parser refuses all of them too, naming
the field (it may run against an older CRD).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from crd_cases import apply, assert_refused_twice, llmservice

from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB, TiB
from rankguard_sim.kube.cluster import ControlPlane

pytestmark = pytest.mark.cluster


def service(name: str, **spec: Any) -> dict[str, Any]:
    return llmservice(name, "meta-llama/Meta-Llama-3-8B", **spec)


def mounts(container: str, *paths: str, init: bool = False) -> dict[str, Any]:
    c: dict[str, Any] = {"name": container, "volumeMounts": [{"name": "data", "mountPath": p} for p in paths]}
    if container != "vllm":
        c["image"] = "busybox"
    key = "initContainers" if init else "containers"
    return {"template": {"spec": {"volumes": [{"name": "data", "emptyDir": {}}], key: [c]}}}


# (case, spec, what the API server says, what the operator says)
REFUSED_AT_APPLY: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "vllm-dev",
        mounts("vllm", "/dev"),
        "cannot be at or under\n/dev, /proc or /sys",
        "containers[vllm].volumeMounts[0].mountPath '/dev' is at or under /dev",
    ),
    (
        "vllm-dev-double-slash-shm",
        mounts("vllm", "/dev//shm"),
        "cannot be at or under\n/dev, /proc or /sys",
        "containers[vllm].volumeMounts[0].mountPath '/dev//shm' is rankguard's",
    ),
    (
        "sidecar-proc",
        mounts("proxy", "/data", "/proc/sys"),
        "template.spec.containers[*].volumeMounts[*].mountPath cannot be at or under",
        "containers[proxy].volumeMounts[1].mountPath '/proc/sys' is at or under /proc",
    ),
    (
        "init-sys",
        mounts("prepare", "/sys", init=True),
        "template.spec.initContainers[*].volumeMounts[*].mountPath cannot be at or under",
        "initContainers[prepare].volumeMounts[0].mountPath '/sys' is at or under /sys",
    ),
    (
        "dot-dot",
        mounts("vllm", "/data/../opt/rankguard/agent"),
        "cannot have a '..' component",
        "'/data/../opt/rankguard/agent' has a '..' component",
    ),
    (
        "under-the-agent",
        mounts("vllm", "/opt/rankguard/agent/bin"),
        "/opt/rankguard/agent (or below it)",
        "mountPath '/opt/rankguard/agent/bin' is rankguard's",
    ),
    (
        "cache-at-dev",
        {"modelCache": {"size": "1Gi", "mountPath": "/dev"}},
        "modelCache.mountPath must not be at or under /dev, /proc or /sys",
        "spec.modelCache.mountPath '/dev' is at or under /dev",
    ),
    (
        "cache-dot-dot",
        {"modelCache": {"size": "1Gi", "mountPath": "/models/../srv"}},
        "modelCache.mountPath must not have a '..' component",
        "spec.modelCache.mountPath '/models/../srv' has a '..' component",
    ),
    (
        "margin-2-62",
        {"memory": {"safetyMarginBytes": 2**62}},
        "spec.memory.safetyMarginBytes: Invalid value",
        "spec.memory.safetyMarginBytes must be between 0 and 1099511627776",
    ),
    (
        "floor-2-tib",
        {"remediation": {"minKVCacheBytes": 2 * TiB}},
        "spec.remediation.minKVCacheBytes: Invalid value",
        "spec.remediation.minKVCacheBytes must be between 1 and 1099511627776",
    ),
    (
        "pin-2-tib",
        {"memory": {"kvCacheMemoryBytes": 2 * TiB}},
        "spec.memory.kvCacheMemoryBytes: Invalid value",
        "spec.memory.kvCacheMemoryBytes must be between 1 and 1099511627776",
    ),
]


@pytest.mark.parametrize(
    ("case", "spec", "server_says", "operator_says"), REFUSED_AT_APPLY, ids=[c[0] for c in REFUSED_AT_APPLY]
)
def test_system_paths_dot_dot_and_absurd_byte_figures_are_refused_at_apply_and_by_the_operator(  # noqa: PLR0917 - parametrized
    cluster: ControlPlane,
    crd: str,
    namespace: str,
    case: str,
    spec: dict[str, Any],
    server_says: str,
    operator_says: str,
) -> None:
    assert_refused_twice(cluster, namespace, service(case, **spec), server_says, operator_says)


# Spellings CEL's prefix tests cannot see through: the API server stores them, the operator
# normalises and refuses them (phase Failed, InvalidSpec), naming the field.
REFUSED_BY_THE_OPERATOR: list[tuple[str, dict[str, Any], str]] = [
    ("agent-dot", mounts("vllm", "/opt/rankguard/./agent"), "'/opt/rankguard/./agent' is rankguard's"),
    (
        "agent-double-slash",
        mounts("vllm", "/opt//rankguard/agent/"),
        "'/opt//rankguard/agent/' is rankguard's",
    ),
    ("leading-double-slash-dev", mounts("proxy", "//dev/fuse"), "'//dev/fuse' is at or under /dev"),
    (
        "cache-dot",
        {"modelCache": {"claimName": "weights"}, **mounts("vllm", "/root/.cache/./huggingface/")},
        "containers[vllm].volumeMounts[0].mountPath '/root/.cache/./huggingface/' is rankguard's",
    ),
    (
        "cache-at-the-agent",
        {"modelCache": {"size": "1Gi", "mountPath": "/opt/rankguard//agent"}},
        "spec.modelCache.mountPath '/opt/rankguard//agent' must be an absolute path other than",
    ),
]


@pytest.mark.parametrize(
    ("case", "spec", "operator_says"), REFUSED_BY_THE_OPERATOR, ids=[c[0] for c in REFUSED_BY_THE_OPERATOR]
)
def test_another_spelling_of_a_reserved_path_is_refused_by_the_operator(  # noqa: PLR0917 - parametrized
    cluster: ControlPlane, crd: str, namespace: str, case: str, spec: dict[str, Any], operator_says: str
) -> None:
    obj = service(case, **spec)
    r = apply(cluster, namespace, obj)
    assert r.returncode == 0, r.stderr
    stored = json.loads(cluster.kubectl("get", "llmservice", case, "-n", namespace, "-o", "json").stdout)
    with pytest.raises(SpecError) as exc:
        parse_spec(stored["spec"])
    assert operator_says in str(exc.value)


def test_ordinary_mounts_and_byte_figures_up_to_the_bound_are_accepted(
    cluster: ControlPlane, crd: str, namespace: str
) -> None:
    spec = {
        **mounts("vllm", "/data", "/root/.cache/huggingface/hub", "/developer"),
        "modelCache": {"claimName": "weights", "mountPath": "/root/.cache/huggingface/"},
        "memory": {"safetyMarginBytes": TiB, "minHeadroomBytes": GiB, "gpuMemoryBytes": TiB},
        "remediation": {"minKVCacheBytes": 1, "maxKVCacheBytes": TiB},
    }
    obj = service("ordinary", **spec)
    r = apply(cluster, namespace, obj)
    assert r.returncode == 0, r.stderr
    stored = json.loads(
        cluster.kubectl("get", "llmservice", "ordinary", "-n", namespace, "-o", "json").stdout
    )
    parsed = parse_spec(stored["spec"])
    assert parsed.model_cache is not None and parsed.model_cache.mount_path == "/root/.cache/huggingface"
    assert parsed.memory.safety_margin_bytes == TiB
