"""Pure pieces of the process kubelet: turning a pod spec into what a local process needs.

Everything here is a function of plain data (the pod as a dict, the way the API serves it),
so the rules a kubelet applies can be tested without a cluster:

* `expand` is the kubelet's `$(VAR)` expansion (`$$` escapes, unknown names stay literal);
* `container_env` resolves `env` / `envFrom` in order, each value expanded against the
  variables defined before it;
* `PathMap` rewrites container paths (volume mount paths, the termination-message path) to
  the local folders that stand in for them;
* `resolve_command` applies the image's ENTRYPOINT/CMD rules and the explicit command table;
* `backoff_delay`, `IpPool` and `quantity_bytes` are the small rules around them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"  # the device plugin's "mixed" strategy: one per profile
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"

Pod = Mapping[str, Any]
Container = Mapping[str, Any]
# (kind, namespace, name, key) -> value or None when absent; kind is "configmap" or "secret".
KeyLookup = Callable[[str, str, str, str], "str | None"]
# (kind, namespace, name) -> all keys of that object, or None when absent.
ObjectLookup = Callable[[str, str, str], "Mapping[str, str] | None"]


class SpecError(ValueError):
    """The pod asks for something the kubelet cannot give; the message is shown in status."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# ------------------------------------------------------------------------------ $(VAR) expansion


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Expand `$(NAME)` the way the kubelet does for env values, command and args.

    `$$` is an escaped `$`; `$(NAME)` with NAME undefined is left as written; a `$` that
    starts no reference (or an unclosed `$(`) is kept literally.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : close]
            out.append(variables.get(name, f"$({name})"))
            i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


# ------------------------------------------------------------------------------ quantities


def quantity(value: object) -> Decimal:
    return Decimal(parse_quantity(value))


def quantity_bytes(value: object) -> int:
    """A memory quantity ("1Gi", "512M", "1e9") as whole bytes (rounded up, as the API does)."""
    return math.ceil(quantity(value))


def container_limit(container: Container, resource: str) -> str | None:
    limits = (container.get("resources") or {}).get("limits") or {}
    value = limits.get(resource)
    return None if value is None else str(value)


def memory_limit_bytes(container: Container) -> int | None:
    value = container_limit(container, "memory")
    return None if value is None else quantity_bytes(value)


def device_count(container: Container, resource: str = GPU_RESOURCE) -> int:
    """The container's limit of a device resource (extended resources have limit == request)."""
    value = container_limit(container, resource)
    if value is None:
        requests = (container.get("resources") or {}).get("requests") or {}
        value = requests.get(resource)
    return 0 if value is None else int(quantity(value))


def gpu_count(container: Container) -> int:
    """The container's `nvidia.com/gpu` limit (extended resources must have limit == request)."""
    return device_count(container, GPU_RESOURCE)


def pod_device_count(pod: Pod, resource: str = GPU_RESOURCE) -> int:
    """Devices the pod holds: like the scheduler's effective request, max(any init, sum of apps)."""
    spec = pod.get("spec") or {}
    init = [device_count(c, resource) for c in spec.get("initContainers") or []]
    apps = sum(device_count(c, resource) for c in spec.get("containers") or [])
    return max([apps, *init])


def pod_gpu_count(pod: Pod) -> int:
    """GPUs the pod holds: like the scheduler's effective request, max(any init, sum of apps)."""
    return pod_device_count(pod, GPU_RESOURCE)


def pod_mig_counts(pod: Pod) -> dict[str, int]:
    """MIG slices the pod holds, per `nvidia.com/mig-<profile>` resource (none: {})."""
    spec = pod.get("spec") or {}
    names = {
        str(name)
        for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
        for kind in ("limits", "requests")
        for name in ((c.get("resources") or {}).get(kind) or {})
        if str(name).startswith(MIG_RESOURCE_PREFIX)
    }
    counts = {name: pod_device_count(pod, name) for name in sorted(names)}
    return {name: n for name, n in counts.items() if n > 0}


# ------------------------------------------------------------------------------ environment


@dataclass(frozen=True)
class PodFacts:
    """What the downward API can tell a container about its pod and node."""

    pod_ip: str
    host_ip: str
    node_name: str
    node_allocatable: Mapping[str, str] = field(default_factory=dict)


def field_value(pod: Pod, path: str, facts: PodFacts) -> str:
    """A downward-API fieldRef (env valueFrom.fieldRef, downwardAPI volume items)."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": facts.node_name,
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": facts.pod_ip,
        "status.podIPs": facts.pod_ip,
        "status.hostIP": facts.host_ip,
        "status.hostIPs": facts.host_ip,
    }
    if path in simple:
        return str(simple[path])
    for prefix, key in (("metadata.labels", "labels"), ("metadata.annotations", "annotations")):
        if path.startswith(prefix + "['") and path.endswith("']"):
            return str((meta.get(key) or {}).get(path[len(prefix) + 2 : -2], ""))
    raise SpecError("CreateContainerConfigError", f"unsupported fieldRef fieldPath {path!r}")


def _resource_ref(container: Container, ref: Mapping[str, Any], facts: PodFacts) -> str:
    resource = str(ref.get("resource", ""))
    kind, _, name = resource.partition(".")
    res = container.get("resources") or {}
    value = (res.get(kind) or {}).get(name)
    if value is None and kind == "requests":
        value = (res.get("limits") or {}).get(name)  # the API defaults requests to limits
    if value is None:
        # An unset limit reads as the node's allocatable, as the kubelet documents.
        value = facts.node_allocatable.get(name, "0")
    divisor = quantity(ref.get("divisor") or "1")
    if divisor <= 0:
        raise SpecError("CreateContainerConfigError", f"resourceFieldRef divisor {divisor} must be > 0")
    return str(math.ceil(quantity(value) / divisor))


def container_env(
    pod: Pod,
    container: Container,
    facts: PodFacts,
    lookup_key: KeyLookup | None = None,
    lookup_object: ObjectLookup | None = None,
) -> dict[str, str]:
    """The container's environment from `envFrom` then `env`, in order, as the kubelet builds it."""
    namespace = str((pod.get("metadata") or {}).get("namespace", ""))
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix") or "")
        for kind, key in (("configmap", "configMapRef"), ("secret", "secretRef")):
            ref = source.get(key)
            if ref is None:
                continue
            data = lookup_object(kind, namespace, ref["name"]) if lookup_object else None
            if data is None:
                if ref.get("optional"):
                    continue
                raise SpecError("CreateContainerConfigError", f'{kind} "{ref["name"]}" not found')
            for k, v in data.items():
                env[prefix + k] = v
    for item in container.get("env") or []:
        name = str(item["name"])
        if "value" in item and item["value"] is not None:
            env[name] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom")
        if not source:
            env[name] = ""
        elif "fieldRef" in source:
            env[name] = field_value(pod, str(source["fieldRef"]["fieldPath"]), facts)
        elif "resourceFieldRef" in source:
            env[name] = _resource_ref(container, source["resourceFieldRef"], facts)
        else:
            kind, ref = (
                ("configmap", source["configMapKeyRef"])
                if "configMapKeyRef" in source
                else ("secret", source.get("secretKeyRef") or {})
            )
            value = (
                lookup_key(kind, namespace, ref.get("name", ""), ref.get("key", "")) if lookup_key else None
            )
            if value is None:
                if ref.get("optional"):
                    continue
                # the kubelet's words: the object's NotFound error, or the key it lacks
                if lookup_object is not None and lookup_object(kind, namespace, ref.get("name", "")) is None:
                    raise SpecError("CreateContainerConfigError", f'{kind} "{ref.get("name")}" not found')
                title = "Secret" if kind == "secret" else "ConfigMap"
                raise SpecError(
                    "CreateContainerConfigError",
                    f"couldn't find key {ref.get('key')} in {title} {namespace}/{ref.get('name')}",
                )
            env[name] = value
    return env


# ------------------------------------------------------------------------------ path rewriting


@dataclass(frozen=True)
class PathMap:
    """Container paths → local paths. Longest container path wins, whole path segments only.

    `exact` maps one file path (the termination-message path) that need not be a folder.
    """

    prefixes: tuple[tuple[str, str], ...] = ()
    exact: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def build(mounts: Iterable[tuple[str, str]], exact: Iterable[tuple[str, str]] = ()) -> PathMap:
        clean = [(m.rstrip("/") or "/", local.rstrip("/") or "/") for m, local in mounts]
        return PathMap(tuple(sorted(clean, key=lambda p: len(p[0]), reverse=True)), tuple(exact))

    def path(self, text: str) -> str:
        """Rewrite `text` when it IS a mapped path or starts with one (else return it unchanged)."""
        for container_path, local in self.exact:
            if text == container_path:
                return local
        for container_path, local in self.prefixes:
            if text == container_path:
                return local
            if text.startswith(container_path + "/"):
                return local + text[len(container_path) :]
        return text

    def arg(self, text: str) -> str:
        """Like `path`, and also the value of a `--flag=/path` argument."""
        rewritten = self.path(text)
        if rewritten != text or not text.startswith("-") or "=" not in text:
            return rewritten
        flag, _, value = text.partition("=")
        return f"{flag}={self.path(value)}"

    def env_value(self, text: str) -> str:
        """Like `path`, and also each element of a ':'-separated list (PYTHONPATH, PATH)."""
        return ":".join(self.path(part) for part in text.split(":"))


# ------------------------------------------------------------------------------ commands


@dataclass(frozen=True)
class ImageTable:
    """The sandbox's stand-in for images: which commands exist, and what an image runs.

    `commands` maps a container's `command[0]` to a local executable; anything else is
    "not found in $PATH", as in an image that lacks it. `entrypoints` maps an image
    repository (no registry, tag or digest) to its ENTRYPOINT and CMD, used only when the
    container sets no `command`.
    """

    commands: Mapping[str, str]
    entrypoints: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)


def image_repository(image: str) -> str:
    """ "docker.io/vllm/vllm-openai:v0.9.1@sha256:…" → "vllm/vllm-openai"."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name[: name.rfind(":")]
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]
    if len(parts) == 2 and parts[0] == "library":
        parts = parts[1:]
    return "/".join(parts)


def container_argv(container: Container, table: ImageTable, env: Mapping[str, str]) -> list[str]:
    """The process argv in container terms: ENTRYPOINT/CMD rules, then `$(VAR)` expansion."""
    command = [str(c) for c in container.get("command") or []]
    args = [str(a) for a in container.get("args") or []]
    if not command:
        entry, cmd = table.entrypoints.get(image_repository(str(container.get("image", ""))), ((), ()))
        command = list(entry)
        if not args:
            args = list(cmd)
    argv = [expand(a, env) for a in [*command, *args]]
    if not argv:
        raise SpecError(
            "StartError",
            f"no command specified: image {container.get('image')!r} has no entrypoint the "
            f"rankguard process kubelet knows (known images: {sorted(table.entrypoints)})",
        )
    return argv


def resolve_executable(argv0: str, table: ImageTable) -> str:
    """The local executable for a container's argv[0], or SpecError("StartError") if none."""
    local = table.commands.get(argv0)
    if local is None:
        raise SpecError(
            "StartError",
            f'exec: "{argv0}": executable file not found in $PATH (the rankguard process kubelet '
            f"maps only {', '.join(sorted(table.commands))})",
        )
    return local


# ------------------------------------------------------------------------------ small rules


def backoff_delay(restarts: int, base: float, cap: float) -> float:
    """Seconds before restart number `restarts` (1 = first restart): base, 2·base, … ≤ cap."""
    if restarts <= 0:
        return 0.0
    return float(min(cap, base * (2 ** min(restarts - 1, 62))))


class IpPool:
    """Loopback pod IPs 127.0.0.2 … 127.0.0.254; the lowest free one first, reused after release.

    Thread-safe, so that several kubelets (nodes) in one process can share one pool and
    never hand out the same address twice.
    """

    def __init__(self, first: int = 2, last: int = 254, prefix: str = "127.0.0.") -> None:
        self._prefix = prefix
        self._first = first
        self._free = set(range(first, last + 1))
        self._owner: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, owner: str) -> str:
        with self._lock:
            if owner in self._owner:
                return self._prefix + str(self._owner[owner])
            if not self._free:
                raise SpecError("FailedCreatePodSandBox", f"no free loopback pod IP left ({self._prefix}*)")
            octet = min(self._free)
            self._free.discard(octet)
            self._owner[owner] = octet
            return self._prefix + str(octet)

    def release(self, owner: str) -> None:
        with self._lock:
            octet = self._owner.pop(owner, None)
            if octet is not None:
                self._free.add(octet)

    def in_use(self) -> dict[str, str]:
        with self._lock:
            return {o: self._prefix + str(x) for o, x in self._owner.items()}

    @property
    def first(self) -> str:
        """The first address the pool hands out (the one every sandbox's first pod gets)."""
        return self._prefix + str(self._first)


def named_port(container: Container, port: object) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    text = str(port)
    if text.isdigit():
        return int(text)
    for p in container.get("ports") or []:
        if p.get("name") == text:
            return int(p["containerPort"])
    raise SpecError("ProbeError", f"container has no port named {text!r}")
