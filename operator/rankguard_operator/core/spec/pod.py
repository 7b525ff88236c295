"""The sections of an LLMService spec that shape the serving pod rather than the budget:
`spec.resources` (CPU, host memory, the GPU resource, /dev/shm), `spec.modelCache` and
`spec.agent`. Parsed like the rest of the spec (core/spec), every failure a SpecError that
names the field.

Pure: no I/O.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.names import GPU_RESOURCE, VLLM_HTTP_PORT, cache_claim_name
from rankguard_operator.core.spec.crd import (
    ACCESS_MODES,
    DEFAULT_AGENT_PORT,
    DEFAULT_CACHE_MOUNT,
    DEFAULT_SAMPLE_HZ,
)
from rankguard_operator.core.spec.fields import (
    SpecError,
    bool_field,
    cpu_quantity,
    memory_quantity,
    number_field,
    required_int,
    section,
    str_field,
)
from rankguard_operator.core.spec.template import RESERVED_MOUNTS, mount_path, under

# A device plugin's extended resource: a domain-prefixed name outside kubernetes.io.
_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class ResourcesSpec:
    """CPU stays a Kubernetes quantity string (rankguard never computes with it); memory is bytes."""

    cpu_request: str | None = None
    cpu_limit: str | None = None
    memory_request_bytes: int | None = None
    memory_limit_bytes: int | None = None
    gpu_resource_name: str = GPU_RESOURCE
    shared_memory_bytes: int | None = None  # the /dev/shm emptyDir's sizeLimit


@dataclass(frozen=True)
class ModelCacheSpec:
    """spec.modelCache: an existing claim (claim_name) or one rankguard creates (size_bytes)."""

    claim_name: str | None = None
    size_bytes: int | None = None
    storage_class: str | None = None
    access_modes: tuple[str, ...] = ("ReadWriteOnce",)
    mount_path: str = DEFAULT_CACHE_MOUNT

    @property
    def created(self) -> bool:
        """True when rankguard creates (and owns) the claim."""
        return self.claim_name is None

    def claim(self, service: str) -> str:
        """The claim the pods mount."""
        return self.claim_name if self.claim_name is not None else cache_claim_name(service)


@dataclass(frozen=True)
class AgentSpec:
    image: str | None = None
    port: int = DEFAULT_AGENT_PORT
    probe: bool = True
    sample_hz: float = DEFAULT_SAMPLE_HZ


def parse_resources(spec: Mapping[str, Any]) -> ResourcesSpec:
    res = section(spec, "resources", "spec")
    req = section(res, "requests", "spec.resources")
    lim = section(res, "limits", "spec.resources")
    mem_req = memory_quantity(req, "memory", "spec.resources.requests")
    mem_lim = memory_quantity(lim, "memory", "spec.resources.limits")
    if mem_req is not None and mem_lim is not None and mem_req > mem_lim:
        raise SpecError(
            f"spec.resources.requests.memory ({req.get('memory')}) exceeds spec.resources.limits.memory "
            f"({lim.get('memory')}); Kubernetes refuses such a pod: raise the limit or lower the request"
        )
    shm = memory_quantity(res, "sharedMemorySize", "spec.resources")
    if shm is not None and mem_lim is not None and shm > mem_lim:
        raise SpecError(
            f"spec.resources.sharedMemorySize ({res.get('sharedMemorySize')}) exceeds "
            f"spec.resources.limits.memory ({lim.get('memory')}): /dev/shm is memory-backed and counts "
            "toward that limit; raise the limit or shrink /dev/shm"
        )
    gpu = str_field(res, "gpuResourceName", "spec.resources", GPU_RESOURCE, max_len=253) or GPU_RESOURCE
    if not _RESOURCE_NAME.match(gpu) or gpu.split("/", 1)[0].endswith("kubernetes.io"):
        raise SpecError(
            f"spec.resources.gpuResourceName {gpu!r} is not a device plugin's extended resource; use e.g. "
            f"{GPU_RESOURCE} or nvidia.com/mig-3g.40gb"
        )
    return ResourcesSpec(
        cpu_request=cpu_quantity(req, "cpu", "spec.resources.requests"),
        cpu_limit=cpu_quantity(lim, "cpu", "spec.resources.limits"),
        memory_request_bytes=mem_req,
        memory_limit_bytes=mem_lim,
        gpu_resource_name=gpu,
        shared_memory_bytes=shm,
    )


def parse_model_cache(spec: Mapping[str, Any]) -> ModelCacheSpec | None:
    w = "spec.modelCache"
    if spec.get("modelCache") is None:
        return None
    c = section(spec, "modelCache", "spec")
    claim = str_field(c, "claimName", w, None, max_len=253)
    size = memory_quantity(c, "size", w)
    if (claim is None) == (size is None):
        raise SpecError(
            "spec.modelCache needs exactly one of claimName (an existing PersistentVolumeClaim) or size "
            "(rankguard creates the claim)"
        )
    storage_class = str_field(c, "storageClassName", w, None, max_len=253)
    raw_modes = c.get("accessModes")
    if claim is not None and (storage_class is not None or raw_modes is not None):
        raise SpecError(
            "spec.modelCache.storageClassName and accessModes describe the claim rankguard creates: give "
            "them together with size, not with claimName"
        )
    modes: tuple[str, ...] = ("ReadWriteOnce",)
    if raw_modes is not None:
        if not isinstance(raw_modes, list) or not raw_modes or any(m not in ACCESS_MODES for m in raw_modes):
            raise SpecError(
                f"spec.modelCache.accessModes must be a non-empty list of {', '.join(ACCESS_MODES)}"
            )
        modes = tuple(dict.fromkeys(raw_modes))
    mount = str_field(c, "mountPath", w, DEFAULT_CACHE_MOUNT) or DEFAULT_CACHE_MOUNT
    # compared after normalising (`/opt/rankguard/./agent` is the agent's); then `..`, /dev,
    # /proc and /sys refused by mount_path
    norm = posixpath.normpath("/" + mount.lstrip("/"))
    if not mount.startswith("/") or norm == "/" or any(under(norm, m) for m in RESERVED_MOUNTS):
        raise SpecError(
            f"spec.modelCache.mountPath {mount!r} must be an absolute path other than /, "
            f"{' and '.join(RESERVED_MOUNTS)}: rankguard mounts its own volumes there"
        )
    path = mount_path(mount, f"{w}.mountPath")
    return ModelCacheSpec(
        claim_name=claim,
        size_bytes=size,
        storage_class=storage_class,
        access_modes=modes,
        mount_path=path,
    )


def parse_agent(spec: Mapping[str, Any]) -> AgentSpec:
    w = "spec.agent"
    a = section(spec, "agent", "spec")
    port = required_int(a, "port", w, DEFAULT_AGENT_PORT, lo=1024, hi=65535)
    if port == VLLM_HTTP_PORT:
        raise SpecError(
            f"spec.agent.port {port} is vLLM's HTTP port in the same pod; choose another, e.g. "
            f"{DEFAULT_AGENT_PORT}"
        )
    hz = number_field(a, "sampleHz", w, DEFAULT_SAMPLE_HZ, lo=0.0, hi=100.0)
    assert hz is not None
    if hz <= 0:
        raise SpecError("spec.agent.sampleHz must be above 0 samples per second")
    return AgentSpec(
        image=str_field(a, "image", w, None),
        port=port,
        probe=bool_field(a, "probe", w, True),
        sample_hz=hz,
    )
