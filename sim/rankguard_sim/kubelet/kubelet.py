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
  (rankguard_sim.kubelet.image): `python3`/`python` → this interpreter without rankguard's own
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
* Network. Each pod gets its own loopback address 127.0.0.X (X from 2 to 254, reused after deletion)
  as pod IP, and every container RANKGUARD_SIM_POD_IP = that address: the sandbox's stand-in for the
  pod's network namespace. A container may bind the pod IP ($(POD_IP)) or a wildcard: the image's
  python (rankguard_sim.kubelet.pod_python) and the fake vLLM turn a bind to 0.0.0.0 ("", and :: on
  a dual-stack socket) into a bind to the pod IP, so pods can listen on the same port apart, as in
  their own namespaces. IPv6-only wildcards and other programs' binds are not rewritten; 127.0.0.1
  is the host's, not the pod's: one sandbox per network namespace (ip_claim.py). Node: `address`.
* GPUs. `nvidia.com/gpu` limits get simulated GPUs (NVIDIA_VISIBLE_DEVICES = their
  UUIDs in rank order, RANKGUARD_SIM_GPU_ROOT = gpu_root); before a container starts,
  each of its GPUs gets the scenario's `comm_init_bytes` for that rank. With `mig`
  (nodegpus.MigLayout) the node also offers MIG slices as `nvidia.com/mig-<profile>`,
  handed out the same way; the Node carries GPU Feature Discovery's labels. `vmm=False`: its
  driver lacks virtual memory management; `imex_channel=True`: its pods find an IMEX channel
  (RANKGUARD_IMEX_CHANNELS_GLOB, a per-pod folder); `start_neighbour` puts a process outside
  any pod on one of its GPUs (physics/neighbour.py).
* Engine release. A container whose image tag names a vLLM version gets
  RANKGUARD_SIM_VLLM_VERSION: the release its fake vLLM and its python's metadata play.
* DNS. Each container gets RANKGUARD_SIM_HOSTS_FILE, a hosts-style file this kubelet keeps from
  the cluster's EndpointSlices (rankguard_sim.kube.dns: `<hostname>.<service>.<namespace>[.svc
  [.cluster.local]]` of pods with a hostname and subdomain); the fake vLLM resolves
  `--master-addr` through it. No DNS server: other programs do not read it.
* Host memory. Each container gets RANKGUARD_SIM_HOST_MEMORY_FILE; a process that
  writes {"pid": …, "rss_bytes": …} there is OOM-killed (SIGKILL to the whole
  container, reason OOMKilled, exit code 137) when rss_bytes exceeds the memory limit.
* Processes. Each container is a process group whose every process carries
  RANKGUARD_SIM_CONTAINER in its environment (the sandbox's cgroup); stdout and stderr go
  to a per-container, per-restart log file under workdir.

Modules: this one holds the node (registration, heartbeat, its pods' workers, pod IPs); nodegpus.py
hands out its GPUs; pod/watch.py watches its pods; pod/api.py makes the API calls for pods;
pod/worker.py runs one pod on pod/containers.py (its containers as processes) and sees this node only as
pod/node.py's Protocol, so it never imports this module; pod/meta.py reads a pod dict; pod/spec.py,
pod/status.py, pod/volumes.py and probes.py are the kubelet's rules as pure functions; pod/proc.py is a
container's processes; image.py is the command table; ip_claim.py claims the pod IPs for the sandbox.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client

from rankguard_agent.gpu.simfiles import pid_alive
from rankguard_sim.kube.api import Throttled
from rankguard_sim.kube.dns import ClusterDns
from rankguard_sim.kubelet import ip_claim
from rankguard_sim.kubelet.image import build_image
from rankguard_sim.kubelet.nodegpus import MigLayout, NodeGpus
from rankguard_sim.kubelet.nodes import heartbeat, register_node
from rankguard_sim.kubelet.pod.api import PodApi
from rankguard_sim.kubelet.pod.meta import TERMINAL_PHASES, meta_of
from rankguard_sim.kubelet.pod.spec import GPU_RESOURCE, ImageTable, IpPool
from rankguard_sim.kubelet.pod.watch import PodWatch
from rankguard_sim.kubelet.pod.worker import PodWorker
from rankguard_sim.physics.neighbour import Growth, Neighbour

log = logging.getLogger("rankguard_sim.kubelet")

# One pool per process: every kubelet (node) in it draws from the same loopback range.
POD_IPS = IpPool()


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
        mig: MigLayout | None = None,
        vmm: bool = True,
        imex_channel: bool = False,
    ) -> None:
        self.node_name = node_name
        self.imex_channel = imex_channel  # its pods find an IMEX channel (most clusters: none)
        self.workdir = Path(workdir)
        self.gpu_root = Path(gpu_root)
        self.hosts_file = self.workdir / "dns" / "hosts"  # every container's RANKGUARD_SIM_HOSTS_FILE
        self._dns: ClusterDns | None = None
        self.gpu_count = gpus
        self.scenario = scenario
        # The sandbox's own knobs for every container (e.g. RANKGUARD_SIM_TIME_SCALE); the
        # pod spec's env still wins, as it does over an image's ENV.
        self.extra_env = dict(extra_env or {})
        # World faults: env for the next N starts of a container with this name (say, a
        # start-up failure that has nothing to do with memory, or a broken agent bundle).
        self._start_faults: dict[str, list[dict[str, str]]] = {}
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
        self._gpus = NodeGpus(self.gpu_root, gpus, gpu_total_bytes, scenario, mig, vmm=vmm)
        self.image_bin = self.workdir / "image" / "bin"
        self._user_table = image_table
        self.image = ImageTable(commands={})
        # Our own clients over the caller's configuration: a long-lived watch and many pod
        # workers must not starve the caller's connection pool (or each other).
        config = copy.deepcopy(api_client.configuration)
        config.connection_pool_maxsize = 32
        self._api = client.ApiClient(config)
        self._watch_api = client.ApiClient(copy.deepcopy(config))
        self.core = client.CoreV1Api(self._api)
        self._lock = threading.Lock()
        self._ips = ip_pool if ip_pool is not None else POD_IPS
        self._workers: dict[str, PodWorker] = {}
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._throttle = Throttled()
        self.api = PodApi(self.core, self._throttle, self._stopping)
        self._watch = PodWatch(
            self._watch_api,
            node_name,
            self._stopping,
            self._throttle,
            on_list=self._sync_pods,
            on_upsert=self._upsert,
            on_gone=self._gone,
        )
        self._started = False
        self._claim = ip_claim.UNCLAIMED  # the pool's first pod IP, claimed while it runs

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("this ProcessKubelet was already started")
        self._started = True
        self._claim = ip_claim.claim(self._ips)  # first: a second sandbox here has our pod IPs
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.image = self._build_image()
        self._gpus.create(seed=self.node_name)
        self.allocatable.update(self._gpus.mig_resources())
        self._retry(
            "register node",
            lambda: register_node(
                self._api,
                self.node_name,
                gpus=self.gpu_count,
                memory=self.memory,
                cpu=self.cpu,
                address=self.address,
                labels=self._gpus.node_labels(),
                resources=self._gpus.mig_resources(),
            ),
        )
        self._dns = ClusterDns(self._watch_api, self.hosts_file, self._throttle)
        self._dns.start()
        for target, name in ((self._heartbeat_loop, "heartbeat"), (self._watch.run, "pod-watch")):
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
        self._watch.interrupt()
        for t in self._threads:
            t.join(timeout=30)
        if self._dns is not None:
            self._dns.stop()
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.shutdown()
        for w in workers:
            w.join(timeout=self.stop_grace + 15)
            if w.is_alive():
                log.error("pod %s: worker did not stop; killing its processes", w.key)
                w.kill_everything()
        self._gpus.stop_neighbours()
        if self.delete_node_on_stop and self._started:
            with contextlib.suppress(Exception):
                self.core.delete_node(self.node_name)
        self._threads.clear()
        self._api.close()
        self._watch_api.close()
        self._claim.release()  # every pod stopped: its IPs are free for another sandbox
        if self._started:
            log.info("node %s: process kubelet stopped", self.node_name)

    def __enter__(self) -> ProcessKubelet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start_neighbour(self, gpu: int | str, hold: int, steps: Sequence[Growth] = ()) -> Neighbour:
        """A process outside any pod on this node's GPU `gpu` (index or UUID): NodeGpus'."""
        return self._gpus.start_neighbour(gpu, hold, steps)

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

    def inject_start_env(self, container: str, count: int, env: Mapping[str, str]) -> None:
        """Give the next `count` starts of containers named `container` this env (over the
        kubelet's own; the pod spec's still wins), e.g. RANKGUARD_SIM_AGENT_BUNDLE=broken
        for the agent's init container."""
        with self._lock:
            self._start_faults.setdefault(container, []).extend(dict(env) for _ in range(count))

    def inject_start_faults(self, container: str, count: int, message: str) -> None:
        """Make the next `count` starts of containers named `container` fail at start-up."""
        self.inject_start_env(container, count, {"RANKGUARD_SIM_FAIL_STARTUP": message})

    def take_start_fault(self, container: str) -> dict[str, str]:
        """Env for one container start: the fault to play, if one is queued for it."""
        with self._lock:
            queue = self._start_faults.get(container)
            return queue.pop(0) if queue else {}

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

    @property
    def gpu_uuids(self) -> list[str]:
        return self._gpus.uuids

    def free_gpus(self) -> list[str]:
        return self._gpus.free()

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
        return self._gpus.acquire(uid, count)

    def acquire_slices(self, uid: str, wanted: Mapping[str, int]) -> dict[str, list[str]] | None:
        """MIG devices per `nvidia.com/mig-<profile>` resource (pod.worker.SliceNode)."""
        return self._gpus.acquire_slices(uid, wanted)

    def free_slices(self, resource: str) -> list[str]:
        return self._gpus.free_slices(resource)

    def acquire_ip(self, uid: str) -> str:
        return self._ips.acquire(uid)

    def release_pod(self, uid: str) -> None:
        self._ips.release(uid)
        self._gpus.release(uid)

    def set_comm_init(self, uuids: list[str], argv: list[str]) -> None:
        self._gpus.set_comm_init(uuids, argv)

    def worker_done(self, uid: str, worker: object) -> None:
        with self._lock:
            if self._workers.get(uid) is worker:
                del self._workers[uid]

    # -- node and watch threads ------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._stopping.wait(self.heartbeat_seconds):
            try:
                heartbeat(self._api, self.node_name)
            except Exception as e:
                self._throttle.warn("node %s: heartbeat failed (%s)", self.node_name, e)

    # The tests reach the watch through these two names.
    @property
    def _watch_resp(self) -> Any:
        return self._watch.resp

    def _watch_once(self, core: client.CoreV1Api, selector: str, rv: str) -> str | None:
        return self._watch.watch_once(core, selector, rv)

    def _sync_pods(self, pods: list[dict[str, Any]]) -> None:
        """After a relist: workers of pods no longer listed vanish; every listed pod is upserted."""
        present = {str(meta_of(p).get("uid")) for p in pods}
        with self._lock:
            gone = [w for uid, w in self._workers.items() if uid not in present]
        for w in gone:
            w.vanish()
        for p in pods:
            self._upsert(p)

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
                self.api.confirm_deletion(pod)
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
        alive = [p for p in alive if pid_alive(p) and not _is_zombie(p)]
        if alive:
            time.sleep(0.05)
    return alive


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
