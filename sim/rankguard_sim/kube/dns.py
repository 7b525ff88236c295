"""Cluster DNS for the sandbox: pod names resolved the way CoreDNS resolves them from EndpointSlices.

A cluster's DNS answers `<hostname>.<service>.<namespace>.svc.cluster.local` (and, through a
pod's resolv.conf search path, `<hostname>.<service>.<namespace>` and `….svc`) with the address
of the endpoint whose `hostname` the EndpointSlice controller published: a pod whose
`spec.hostname` is set and whose `spec.subdomain` names a headless Service that selects it (the
StatefulSet controller gives its pods both). CoreDNS answers for ready endpoints only; the
controller marks an endpoint ready when its pod is Ready and not terminating, or always when the
Service has `publishNotReadyAddresses: true`, so such names resolve before their pods are ready.

The sandbox's pod IPs are loopback addresses (127.0.0.X), which the API server refuses in an
EndpointSlice ("may not be in the loopback range"): the controller-manager's EndpointSlice
controller runs, but its slices never carry the sandbox's pods. So the sandbox applies the
controller's rules itself (`endpoint_slices`: the slices it would publish, from the API's
Services and Pods) and CoreDNS's to them (`records`). `ClusterDns` (each process kubelet runs
one) watches Services and Pods in every namespace and keeps a hosts-style file of those names
(`IP name…` lines, replaced atomically on every change); every container gets its path in
RANKGUARD_SIM_HOSTS_FILE, and `resolve(name, env)` answers from it (an IP literal answers
itself). Only these hostname records: no Service names (cluster IP or headless), no pod-IP names
(`1-2-3-4.ns.pod`), no SRV records.
"""

from __future__ import annotations

import contextlib
import copy
import ipaddress
import json
import os
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rankguard_sim.kube.api import Throttled, raw_call

HOSTS_FILE_ENV = "RANKGUARD_SIM_HOSTS_FILE"
CLUSTER_DOMAIN = "cluster.local"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # the EndpointSlice's Service
_HEADER = "# rankguard sandbox cluster DNS: the pod hostnames of headless Services (kube/dns.py)\n"


def records(endpoint_slice: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...]]]:
    """(address, names) for every address of every ready endpoint with a hostname in one slice."""
    meta = endpoint_slice.get("metadata") or {}
    service = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    namespace = meta.get("namespace")
    if not service or not namespace:
        return []
    found: list[tuple[str, tuple[str, ...]]] = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        hostname = endpoint.get("hostname")
        if not hostname or (endpoint.get("conditions") or {}).get("ready") is False:
            continue  # CoreDNS: unset `ready` counts as ready
        base = f"{hostname}.{service}.{namespace}".lower()
        names = (base, f"{base}.svc", f"{base}.svc.{CLUSTER_DOMAIN}")
        found += [(str(address), names) for address in endpoint.get("addresses") or []]
    return found


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def endpoint_slices(
    services: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The EndpointSlices the EndpointSlice controller would publish for the headless Services
    (one slice each, its endpoints' addresses, hostnames and readiness; ports and topology left
    out): the pods in the Service's namespace that its selector matches, that have an IP and
    have not ended (Succeeded, Failed); `hostname` when the pod's spec.hostname is set and its
    spec.subdomain is the Service's name; ready as the controller decides (k8s.io/endpointslice,
    podToEndpoint)."""
    pods = list(pods)
    slices = []
    for svc in services:
        meta, spec = svc.get("metadata") or {}, svc.get("spec") or {}
        if spec.get("clusterIP") != "None":
            continue  # CoreDNS answers hostnames of headless Services only
        name, namespace = meta.get("name"), meta.get("namespace")
        endpoints = []
        for pod in pods:
            pmeta, pspec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
            if pmeta.get("namespace") != namespace or not _selects(
                spec.get("selector") or {}, pmeta.get("labels") or {}
            ):
                continue
            if not status.get("podIP") or status.get("phase") in ("Succeeded", "Failed"):
                continue
            terminating = pmeta.get("deletionTimestamp") is not None
            ready = bool(spec.get("publishNotReadyAddresses")) or (_ready(pod) and not terminating)
            endpoint: dict[str, Any] = {"addresses": [status["podIP"]], "conditions": {"ready": ready}}
            if pspec.get("hostname") and pspec.get("subdomain") == name:
                endpoint["hostname"] = pspec["hostname"]
            endpoints.append(endpoint)
        labels = {SERVICE_NAME_LABEL: name}
        slices.append({"metadata": {"namespace": namespace, "labels": labels}, "endpoints": endpoints})
    return slices


def render_hosts(endpoint_slices: Iterable[Mapping[str, Any]]) -> str:
    """The hosts file for these slices: one `IP name name name` line per address, sorted."""
    lines = sorted({f"{addr} {' '.join(names)}" for s in endpoint_slices for addr, names in records(s)})
    return _HEADER + "".join(line + "\n" for line in lines)


def write_hosts(path: Path, text: str) -> None:
    """Replace the file atomically (a reader sees the old file or the new one, never a part)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".hosts.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def resolve(name: str, env: Mapping[str, str]) -> str | None:
    """The address `name` has in the sandbox's DNS (the file in RANKGUARD_SIM_HOSTS_FILE): an IP
    literal is itself; a name not (yet) there is None, as NXDOMAIN would be."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(name))
    path = env.get(HOSTS_FILE_ENV)
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    wanted = name.rstrip(".").lower()
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) > 1 and wanted in fields[1:]:
            return fields[0]
    return None


class ClusterDns:
    """Keeps the hosts file at `path` in step with the cluster's headless Services and Pods.

    `start()` writes the file and starts one thread per kind that lists, then watches, every
    object of it (relisting after 410 or a dropped watch); `stop()` cuts the watches, joins them.
    """

    def __init__(
        self, api_client: Any, path: str | os.PathLike[str], throttle: Throttled | None = None
    ) -> None:
        # Imported here: the resolver above runs in every fake vLLM, which needs no API client.
        from kubernetes import client  # noqa: PLC0415

        self.path = Path(path)
        self._api = client.ApiClient(copy.deepcopy(api_client.configuration))
        core = client.CoreV1Api(self._api)
        self._lists = {
            "Service": core.list_service_for_all_namespaces,
            "Pod": core.list_pod_for_all_namespaces,
        }
        self._throttle = throttle or Throttled()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._resps: dict[str, Any] = {}
        self._objects: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in self._lists}
        self._written: str | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        self._write()
        for kind in self._lists:
            t = threading.Thread(target=self._run, args=(kind,), name=f"cluster-dns-{kind}", daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            resps = list(self._resps.values())
        for resp in resps:
            with contextlib.suppress(Exception):
                resp.shutdown()
        for t in self._threads:
            t.join(timeout=30)
        self._api.close()

    def _write(self) -> None:
        with self._lock:
            services = list(self._objects["Service"].values())
            pods = list(self._objects["Pod"].values())
            text = render_hosts(endpoint_slices(services, pods))
            if text != self._written:
                write_hosts(self.path, text)
                self._written = text

    def _run(self, kind: str) -> None:
        rv: str | None = None
        delay = 0.2
        while not self._stopping.is_set():
            try:
                if rv is None:
                    doc = raw_call(self._lists[kind])
                    with self._lock:
                        self._objects[kind] = {str(o["metadata"]["uid"]): o for o in doc.get("items") or []}
                    self._write()
                    rv = str((doc.get("metadata") or {}).get("resourceVersion", ""))
                rv = self._watch(kind, rv)
                delay = 0.2
            except Exception as e:
                if self._stopping.is_set():
                    break
                self._throttle.warn("cluster DNS: %s watch failed (%s); re-listing", kind, e)
                rv = None
                self._stopping.wait(delay)
                delay = min(delay * 2, 5.0)

    def _watch(self, kind: str, rv: str) -> str | None:
        """Follow one watch to its end; the last resourceVersion, or None to relist (410)."""
        from kubernetes.watch.watch import iter_resp_lines  # noqa: PLC0415 - see __init__

        resp = self._lists[kind](
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=60,
            _preload_content=False,
        )
        with self._lock:
            self._resps[kind] = resp
        try:
            if self._stopping.is_set():
                return rv
            for line in iter_resp_lines(resp):
                event = json.loads(line)
                change, obj = event.get("type"), event.get("object") or {}
                if change == "ERROR":
                    if obj.get("code") == 410:
                        return None
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                meta = obj.get("metadata") or {}
                rv = str(meta.get("resourceVersion") or rv)
                if change not in ("ADDED", "MODIFIED", "DELETED"):
                    continue  # BOOKMARK: only the resourceVersion moves
                with self._lock:
                    if change == "DELETED":
                        self._objects[kind].pop(str(meta.get("uid")), None)
                    else:
                        self._objects[kind][str(meta.get("uid"))] = obj
                self._write()
        finally:
            with self._lock:
                self._resps.pop(kind, None)
            with contextlib.suppress(Exception):
                resp.close()
            with contextlib.suppress(Exception):
                resp.release_conn()
        return rv
