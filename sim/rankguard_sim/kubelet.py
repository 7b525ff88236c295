"""The process kubelet: runs the pods bound to a simulated GPU node as local processes.

`ProcessKubelet(api, "gpu-node-1", workdir=…, gpu_root=…).start()` registers the Node
(`nvidia.com/gpu` capacity, memory), keeps its Lease and Ready condition fresh, creates
the node's simulated GPUs (docs/sim-world.md), watches the Pods bound to it and runs
them the way a kubelet does: init containers in order, then the containers; probes;
restarts with exponential back-off (CrashLoopBackOff); OOMKilled when a container's
simulated host memory exceeds its memory limit; graceful deletion; and the pod status a
kubelet writes (phase, conditions, container states, termination messages).
`stop()` kills every process it started and joins every thread.

Where the sandbox differs from a real node, and only here:

* Images. Nothing is pulled. A container's `command[0]` (after the image's ENTRYPOINT /
  CMD rules for containers that give no command) must be in a small, explicit table
  (rankguard_sim.image): `python3`/`python` → this interpreter without rankguard's own
  packages, `vllm` → the fake vLLM, `rankguard-agent-install DEST` → a copy of
  agent/rankguard_agent (and pynvml) into DEST. The table's folder is first on the
  container's PATH. Any other command fails to start with reason StartError, exit code
  128 and the runtime's "executable file not found in $PATH" message.
* Paths. A container has no filesystem of its own, so container paths are rewritten to
  local folders: each emptyDir is a temp folder of the pod; configMap, secret,
  downwardAPI and projected (service-account token) volumes are written into folders;
  a hostPath is the host path itself. Every string in command/args and env values that
  starts with a volumeMount's mountPath (also the value of a `--flag=/path` argument and
  each element of a `:`-separated env value) gets the local folder instead; workingDir
  likewise. The terminationMessagePath (default /dev/termination-log) is a per-container
  local file, and an argument or env value equal to it is rewritten too.
* Network. Each pod gets its own loopback address 127.0.0.X (X from 2 to 254, reused
  after deletion) as pod IP; containers must bind to it ($(POD_IP)) to be reachable
  apart from other pods. The node's address is `address`.
* GPUs. `nvidia.com/gpu` limits get simulated GPUs (NVIDIA_VISIBLE_DEVICES = their
  UUIDs in rank order, RANKGUARD_SIM_GPU_ROOT = gpu_root); before a container starts,
  each of its GPUs gets the scenario's `comm_init_bytes` for that rank.
* Host memory. Each container gets RANKGUARD_SIM_HOST_MEMORY_FILE; a process that
  writes {"pid": …, "rss_bytes": …} there is OOM-killed (SIGKILL to the whole
  container, reason OOMKilled, exit code 137) when rss_bytes exceeds the memory limit.
* Processes. Each container is a process group whose every process carries
  RANKGUARD_SIM_CONTAINER in its environment (the sandbox's cgroup); stdout and stderr go
  to a per-container, per-restart log file under workdir.

Modules: this one holds the node (registration, heartbeat, pod watch) and what pods share
(GPUs, IPs, API calls); podworker.py runs one pod; podspec.py, podstatus.py,
podvolumes.py and probes.py are the kubelet's rules as pure functions; podproc.py is a
container's processes; image.py is the command table.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from . import gpus as simgpus
from .image import build_image
from .nodes import heartbeat, register_node
from .podspec import GPU_RESOURCE, ImageTable, IpPool
from .podworker import TERMINAL_PHASES, PodWorker, meta_of, pod_key, spec_of
from .scenario import Scenario, load_scenario

log = logging.getLogger("rankguard_sim.kubelet")

GIB = 1 << 30
DEFAULT_GPU_TOTAL_BYTES = 80 * GIB
# One pool per process: every kubelet (node) in it draws from the same loopback range.
POD_IPS = IpPool()


def _raw(call: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call the API and return the JSON body as a dict (the sim works on plain dicts)."""
    resp = call(*args, _preload_content=False, **kwargs)
    try:
        doc = json.loads(resp.data)
    finally:
        resp.release_conn()
    return doc if isinstance(doc, dict) else {}


class _Throttled:
    """Logs one warning per distinct message per interval: API trouble must not flood logs."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self._last: dict[str, float] = {}

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(msg, -1e9) >= self.every:
            self._last[msg] = now
            log.warning(msg, *args)


# ------------------------------------------------------------------------------ the kubelet


class ProcessKubelet:
    """A kubelet for one simulated GPU node. `start()` returns at once; `stop()` cleans up."""

    def __init__(
        self,
        api_client: client.ApiClient,
        node_name: str,
        *,
        workdir: str | os.PathLike[str],
        gpu_root: str | os.PathLike[str],
        gpus: int = 8,
        gpu_total_bytes: int | None = None,
        scenario: str | None = None,
        address: str = "127.0.0.1",
        backoff_base: float = 0.5,
        backoff_cap: float = 10.0,
        image_table: ImageTable | None = None,
        memory: str = "512Gi",
        cpu: str = "64",
        heartbeat_seconds: float = 2.0,
        grace_cap: float = 10.0,
        stop_grace: float = 2.0,
        delete_node_on_stop: bool = False,
        ip_pool: IpPool | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.node_name = node_name
        self.workdir = Path(workdir)
        self.gpu_root = Path(gpu_root)
        self.gpu_count = gpus
        self.scenario = scenario
        # The sandbox's own knobs for every container (e.g. RANKGUARD_SIM_TIME_SCALE); the
        # pod spec's env still wins, as it does over an image's ENV.
        self.extra_env = dict(extra_env or {})
        # A world fault: the next N starts of a container with this name fail at start-up for
        # a reason that has nothing to do with memory (say, a broken driver on the node).
        self._start_faults: dict[str, list[str]] = {}
        self.address = address
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.memory = memory
        self.cpu = cpu
        self.allocatable = {"cpu": cpu, "memory": memory, GPU_RESOURCE: str(gpus)}
        self.heartbeat_seconds = heartbeat_seconds
        self.grace_cap = grace_cap
        self.stop_grace = stop_grace
        self.delete_node_on_stop = delete_node_on_stop
        self._scenario_obj: Scenario | None = None
        self._gpu_name = simgpus.DEFAULT_NAME
        self.gpu_total_bytes = gpu_total_bytes or DEFAULT_GPU_TOTAL_BYTES
        if scenario:
            self._scenario_obj = load_scenario(scenario)
            self._gpu_name = f"{self._scenario_obj.gpu.name} (simulated)"
            self.gpu_total_bytes = gpu_total_bytes or int(self._scenario_obj.gpu.total_bytes)
        self.image_bin = self.workdir / "image" / "bin"
        self._user_table = image_table
        self.image = ImageTable(commands={})
        self.gpu_uuids: list[str] = []
        # Our own clients over the caller's configuration: a long-lived watch and many pod
        # workers must not starve the caller's connection pool (or each other).
        config = copy.deepcopy(api_client.configuration)
        config.connection_pool_maxsize = 32
        self._api = client.ApiClient(config)
        self._watch_api = client.ApiClient(copy.deepcopy(config))
        self.core = client.CoreV1Api(self._api)
        self._lock = threading.Lock()
        self._ips = ip_pool if ip_pool is not None else POD_IPS
        self._gpu_owner: dict[str, str] = {}  # uuid -> pod uid
        self._workers: dict[str, PodWorker] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watch_resp: Any = None
        self._throttle = _Throttled()
        self._started = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("this ProcessKubelet was already started")
        self._started = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.image = self._build_image()
        self.gpu_uuids = simgpus.create_gpus(
            self.gpu_root, self.gpu_count, self.gpu_total_bytes, seed=self.node_name, name=self._gpu_name
        )
        self._retry(
            "register node",
            lambda: register_node(
                self._api,
                self.node_name,
                gpus=self.gpu_count,
                memory=self.memory,
                cpu=self.cpu,
                address=self.address,
            ),
        )
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch_loop, "pod-watch")):
            t = threading.Thread(target=target, name=f"kubelet-{self.node_name}-{name}", daemon=True)
            self._threads.append(t)
            t.start()
        log.info(
            "node %s: process kubelet started with %d GPU(s) under %s",
            self.node_name,
            self.gpu_count,
            self.gpu_root,
        )

    def stop(self) -> None:
        """Kill every container, join every thread, release every GPU and IP. Idempotent."""
        self._stopping.set()
        with self._lock:
            resp = self._watch_resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()
        for t in self._threads:
            t.join(timeout=30)
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.shutdown()
        for w in workers:
            w.join(timeout=self.stop_grace + 15)
            if w.is_alive():
                log.error("pod %s: worker did not stop; killing its processes", w.key)
                w.kill_everything()
        if self.delete_node_on_stop and self._started:
            with contextlib.suppress(Exception):
                self.core.delete_node(self.node_name)
        self._threads.clear()
        self._api.close()
        self._watch_api.close()
        if self._started:
            log.info("node %s: process kubelet stopped", self.node_name)

    def __enter__(self) -> ProcessKubelet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _build_image(self) -> ImageTable:
        table = build_image(self.image_bin)
        if self._user_table is None:
            return table
        commands = dict(table.commands)
        for name, target in self._user_table.commands.items():
            link = self.image_bin / name
            with contextlib.suppress(FileNotFoundError):
                link.unlink()
            link.symlink_to(target)  # so a command run inside a container finds it on PATH too
            commands[name] = str(link)
        return ImageTable(commands, {**table.entrypoints, **self._user_table.entrypoints})

    def _retry(self, what: str, call: Callable[[], object]) -> None:
        delay = 0.2
        while not self._stopping.is_set():
            try:
                call()
                return
            except Exception as e:
                self._throttle.warn("node %s: %s failed (%s); retrying", self.node_name, what, e)
                self._stopping.wait(delay)
                delay = min(delay * 2, 5.0)

    def warn_throttled(self, msg: str, *args: object) -> None:
        self._throttle.warn(msg, *args)

    # -- introspection (tests, demo) ---------------------------------------------------------

    def _worker(self, namespace: str, name: str) -> PodWorker | None:
        with self._lock:
            for w in self._workers.values():
                if w.namespace == namespace and w.pod_name == name:
                    return w
        return None

    def inject_start_faults(self, container: str, count: int, message: str) -> None:
        """Make the next `count` starts of containers named `container` fail at start-up."""
        with self._lock:
            self._start_faults.setdefault(container, []).extend([message] * count)

    def take_start_fault(self, container: str) -> dict[str, str]:
        """Env for one container start: the fault to play, if one is queued for it."""
        with self._lock:
            queue = self._start_faults.get(container)
            if not queue:
                return {}
            return {"RANKGUARD_SIM_FAIL_STARTUP": queue.pop(0)}

    def pod_pids(self, namespace: str, name: str) -> list[int]:
        w = self._worker(namespace, name)
        return w.pids() if w is not None else []

    def all_pids(self) -> list[int]:
        with self._lock:
            workers = list(self._workers.values())
        return sorted({pid for w in workers for pid in w.pids()})

    def pod_ip(self, namespace: str, name: str) -> str | None:
        w = self._worker(namespace, name)
        return w.pod_ip if w is not None else None

    def gpu_assignments(self) -> dict[str, list[str]]:
        """Pod key ("ns/name") -> the GPUs it holds."""
        with self._lock:
            return {w.key: list(w.gpus) for w in self._workers.values() if not w.released and w.gpus}

    def free_gpus(self) -> list[str]:
        with self._lock:
            return [u for u in self.gpu_uuids if u not in self._gpu_owner]

    def log_path(self, namespace: str, name: str, container: str, previous: bool = False) -> Path | None:
        w = self._worker(namespace, name)
        if w is None:
            return None
        for slot in [*w.init_slots, *w.slots]:
            if slot.name == container:
                instance = slot.instance - 1 if previous or slot.proc is None else slot.instance
                return w.dir / "containers" / container / f"{max(instance, 0)}.log"
        return None

    # -- resources (called by workers) --------------------------------------------------------

    def acquire_gpus(self, uid: str, count: int) -> list[str] | None:
        with self._lock:
            free = [u for u in self.gpu_uuids if u not in self._gpu_owner]
            if count > len(free):
                return None
            got = free[:count]
            for u in got:
                self._gpu_owner[u] = uid
            return got

    def acquire_ip(self, uid: str) -> str:
        return self._ips.acquire(uid)

    def release_pod(self, uid: str) -> None:
        with self._lock:
            self._ips.release(uid)
            for u in [u for u, owner in self._gpu_owner.items() if owner == uid]:
                del self._gpu_owner[u]
        with contextlib.suppress(OSError):
            simgpus.cleanup_dead(self.gpu_root)

    def set_comm_init(self, uuids: list[str]) -> None:
        """The world's fact for each rank: what CUDA context + NCCL cost on that GPU."""
        if self._scenario_obj is None:
            return
        for rank, uuid in enumerate(uuids):
            simgpus.set_comm_init_bytes(self.gpu_root, uuid, int(self._scenario_obj.comm_init_bytes(rank)))

    def worker_done(self, worker: PodWorker) -> None:
        with self._lock:
            if self._workers.get(worker.uid) is worker:
                del self._workers[worker.uid]

    # -- API (called by workers) --------------------------------------------------------------

    def patch_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        # A JSON merge patch replaces the status lists whole: the kubelet owns them. The uid
        # is a precondition, as in the kubelet's own patch: a pod re-created under the same
        # name must not get the old one's status.
        # _raw reads the body before the connection goes back to the pool: a connection
        # returned with an unread body hands the next request that body as its status line.
        _raw(
            self.core.patch_namespaced_pod_status,
            name,
            namespace,
            {"metadata": {"uid": uid}, "status": status},
            _content_type="application/merge-patch+json",
        )

    def pod_exists(self, worker: PodWorker) -> bool:
        """Whether the worker's pod (same uid) is still in the API; True when unsure."""
        try:
            doc = _raw(self.core.read_namespaced_pod, worker.pod_name, worker.namespace)
        except ApiException as e:
            return bool(e.status != 404)
        except Exception:
            return True
        return str(meta_of(doc).get("uid")) == worker.uid

    def confirm_deletion(self, pod: Mapping[str, Any]) -> None:
        meta = meta_of(pod)
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=str(meta.get("uid")))
        )
        for attempt in range(10):
            try:
                _raw(self.core.delete_namespaced_pod, str(meta["name"]), str(meta["namespace"]), body=body)
                return
            except ApiException as e:
                if e.status in (404, 409):
                    return  # gone already, or a new pod took the name
                self._throttle.warn("pod %s: confirming deletion failed (%s)", pod_key(pod), e.status)
            except Exception as e:
                self._throttle.warn("pod %s: confirming deletion failed (%s)", pod_key(pod), e)
            if self._stopping.wait(min(0.2 * 2**attempt, 3.0)):
                return

    def lookup_object(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        read = (
            self.core.read_namespaced_config_map if kind == "configmap" else self.core.read_namespaced_secret
        )
        try:
            doc = _raw(read, name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        data = {str(k): str(v) for k, v in (doc.get("data") or {}).items()}
        if kind == "secret":
            data = {k: base64.b64decode(v).decode("utf-8", errors="replace") for k, v in data.items()}
        return data

    def lookup_key(self, kind: str, namespace: str, name: str, key: str) -> str | None:
        data = self.lookup_object(kind, namespace, name)
        return None if data is None else data.get(key)

    def service_account_token(self, pod: Mapping[str, Any], source: Mapping[str, Any]) -> str:
        meta, spec = meta_of(pod), spec_of(pod)
        body: dict[str, Any] = {
            "spec": {
                "expirationSeconds": int(source.get("expirationSeconds") or 3607),
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            }
        }
        if source.get("audience"):
            body["spec"]["audiences"] = [source["audience"]]
        doc = _raw(
            self.core.create_namespaced_service_account_token,
            str(spec.get("serviceAccountName") or "default"),
            str(meta["namespace"]),
            body,
        )
        return str((doc.get("status") or {}).get("token", ""))

    # -- node and watch threads ------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.heartbeat_seconds):
            try:
                heartbeat(self._api, self.node_name)
            except Exception as e:
                self._throttle.warn("node %s: heartbeat failed (%s)", self.node_name, e)

    def _watch_loop(self) -> None:
        core = client.CoreV1Api(self._watch_api)
        selector = f"spec.nodeName={self.node_name}"
        rv: str | None = None
        delay = 0.2
        while not self._stopping.is_set():
            try:
                if rv is None:
                    rv = self._relist(core, selector)
                rv = self._watch_once(core, selector, rv)
                delay = 0.2
            except Exception as e:
                if self._stopping.is_set():
                    break
                self._throttle.warn("node %s: pod watch failed (%s); re-listing", self.node_name, e)
                rv = None
                self._stopping.wait(delay)
                delay = min(delay * 2, 5.0)

    def _relist(self, core: client.CoreV1Api, selector: str) -> str:
        doc = _raw(core.list_pod_for_all_namespaces, field_selector=selector)
        pods = doc.get("items") or []
        present = {str(meta_of(p).get("uid")) for p in pods}
        with self._lock:
            gone = [w for uid, w in self._workers.items() if uid not in present]
        for w in gone:
            w.vanish()
        for p in pods:
            self._upsert(p)
        return str((doc.get("metadata") or {}).get("resourceVersion", ""))

    def _watch_once(self, core: client.CoreV1Api, selector: str, rv: str) -> str | None:
        resp = core.list_pod_for_all_namespaces(
            field_selector=selector,
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=300,
            _preload_content=False,
        )
        with self._lock:
            self._watch_resp = resp
        if self._stopping.is_set():  # stop() may have looked for the response before it existed
            resp.release_conn()
            return rv
        try:
            for line in iter_resp_lines(resp):
                if self._stopping.is_set():
                    break
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return None  # too old: relist
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                rv = str(meta_of(obj).get("resourceVersion") or rv)
                if kind == "DELETED":
                    self._gone(obj)
                elif kind in ("ADDED", "MODIFIED"):
                    self._upsert(obj)
        finally:
            with self._lock:
                self._watch_resp = None
            with contextlib.suppress(Exception):
                # A watch left mid-stream must not go back to the pool with unread events.
                resp.close()
            with contextlib.suppress(Exception):
                resp.release_conn()
        return rv

    def _upsert(self, pod: dict[str, Any]) -> None:
        uid = str(meta_of(pod).get("uid"))
        with self._lock:
            worker = self._workers.get(uid)
            if worker is None and not self._stopping.is_set():
                phase = (pod.get("status") or {}).get("phase")
                if meta_of(pod).get("deletionTimestamp"):
                    new = None  # nothing runs for it here: just confirm below
                elif phase in TERMINAL_PHASES:
                    return  # finished before this kubelet knew it
                else:
                    new = worker = PodWorker(self, pod)
                    self._workers[uid] = worker
            else:
                new = None
        if worker is None:
            if meta_of(pod).get("deletionTimestamp") and not self._stopping.is_set():
                self.confirm_deletion(pod)
            return
        if new is not None:
            new.start()
        else:
            worker.update(pod)

    def _gone(self, pod: Mapping[str, Any]) -> None:
        with self._lock:
            worker = self._workers.get(str(meta_of(pod).get("uid")))
        if worker is not None:
            worker.vanish()


def wait_for_pids_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Pids still alive after `timeout` (tests use it to prove nothing was left behind)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if simgpus.pid_alive(p) and not _is_zombie(p)]
        if alive:
            time.sleep(0.05)
    return alive


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
