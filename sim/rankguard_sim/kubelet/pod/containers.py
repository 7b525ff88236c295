"""A pod's containers on the process kubelet's node: the lower half of a pod worker.

`PodContainers` holds one pod's state and turns each container into processes: the
argv, env and local paths a container spec becomes, starting it, recording its exit,
restarting it with back-off, enforcing its memory limit, and stopping it. `PodWorker`
(pod/worker.py) builds the pod's life on top: admission, volumes, probes, status, deletion.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rankguard_agent.gpu.simfiles import VISIBLE_DEVICES_ENV
from rankguard_sim.kube.dns import HOSTS_FILE_ENV
from rankguard_sim.kubelet.pod.meta import meta_of, pod_key, spec_of
from rankguard_sim.kubelet.pod.node import PodNode
from rankguard_sim.kubelet.pod.proc import ContainerProcess, Exit
from rankguard_sim.kubelet.pod.spec import (
    DEFAULT_TERMINATION_MESSAGE_PATH,
    PathMap,
    PodFacts,
    SpecError,
    backoff_delay,
    container_argv,
    container_env,
    memory_limit_bytes,
    resolve_executable,
)
from rankguard_sim.kubelet.pod.status import (
    ContainerView,
    Termination,
    crash_loop_message,
    exit_reason,
    termination_message,
)
from rankguard_sim.kubelet.probes import ProbeTimer, parse_probe
from rankguard_sim.physics import gpus as simgpus
from rankguard_sim.physics.scenario_file import SCENARIO_ENV
from rankguard_sim.vllm_snapshot import ENGINE_VERSION_ENV, image_engine_version

log = logging.getLogger("rankguard_sim.kubelet")

HOST_MEMORY_ENV = "RANKGUARD_SIM_HOST_MEMORY_FILE"
# The pod's IP, for the sandbox's stand-in of its network namespace: a wildcard bind (0.0.0.0)
# by the image's python (pod_python.py) or the fake vLLM binds this address instead.
POD_IP_ENV = "RANKGUARD_SIM_POD_IP"
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class ContainerSlot:
    """One container of a pod: its spec, its status view, its current process."""

    spec: Mapping[str, Any]
    init: bool
    view: ContainerView
    gpus: list[str] = field(default_factory=list)
    proc: ContainerProcess | None = None
    instance: int = 0
    restart_at: float | None = None
    crashes: int = 0  # consecutive, for the back-off
    done: bool = False  # terminated and will not run again
    oom: bool = False
    stop_deadline: float | None = None
    startup: ProbeTimer | None = None
    liveness: ProbeTimer | None = None
    readiness: ProbeTimer | None = None
    exec_path: str = ""

    @property
    def name(self) -> str:
        return self.view.name


def arm_probes(slot: ContainerSlot, started_at: float, key: str) -> None:
    """Fresh probe timers for a container instance that just started (none for init containers)."""

    def timer(probe_key: str, initial: bool) -> ProbeTimer | None:
        probe = slot.spec.get(probe_key)
        if not probe or slot.init:
            return None
        try:
            return ProbeTimer(parse_probe(probe, slot.spec), started_at, initial)
        except SpecError as e:
            log.warning("pod %s: container %s: %s ignored: %s", key, slot.name, probe_key, e.message)
            return None

    slot.startup = timer("startupProbe", False)
    slot.liveness = timer("livenessProbe", True)
    slot.readiness = timer("readinessProbe", False)


class PodContainers(threading.Thread):
    """One pod's identity, folders and container slots, and how its containers run."""

    def __init__(self, kubelet: PodNode, pod: Mapping[str, Any]) -> None:
        super().__init__(name=f"pod-{pod_key(pod)}", daemon=True)
        self.kubelet = kubelet
        self.uid = str(meta_of(pod)["uid"])
        self.namespace = str(meta_of(pod)["namespace"])
        self.pod_name = str(meta_of(pod)["name"])
        self.key = pod_key(pod)
        self._pod: Mapping[str, Any] = pod
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._vanished = False
        self._shutdown = False
        self.pod_ip = ""
        self.start_time = time.time()
        self.dir = kubelet.workdir / "pods" / f"{self.namespace}_{self.pod_name}_{self.uid[:8]}"
        self.volumes: dict[str, Path] = {}
        self.gpus: list[str] = []
        self.slots: list[ContainerSlot] = []
        self.init_slots: list[ContainerSlot] = []
        spec = spec_of(pod)
        self.restart_policy = str(spec.get("restartPolicy") or "Always")
        for c in spec.get("initContainers") or []:
            self.init_slots.append(
                ContainerSlot(
                    c,
                    True,
                    ContainerView(c["name"], str(c.get("image", "")), waiting_reason="PodInitializing"),
                )
            )
        first = "PodInitializing" if self.init_slots else "ContainerCreating"
        for c in spec.get("containers") or []:
            self.slots.append(
                ContainerSlot(
                    c, False, ContainerView(c["name"], str(c.get("image", "")), waiting_reason=first)
                )
            )

    # -- called from other threads ------------------------------------------------------

    def update(self, pod: Mapping[str, Any]) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def vanish(self) -> None:
        self._vanished = True
        self._wake.set()

    def shutdown(self) -> None:
        self._shutdown = True
        self._wake.set()

    def pids(self) -> list[int]:
        found: set[int] = set()
        for slot in [*self.init_slots, *self.slots]:
            proc = slot.proc
            if proc is not None:
                found.update(proc.pids())
        return sorted(found)

    def kill_everything(self) -> None:
        for slot in [*self.init_slots, *self.slots]:
            if slot.proc is not None:
                slot.proc.kill_all()
                slot.proc.wait(5.0)

    # -- the pod as it stands -------------------------------------------------------------

    @property
    def pod(self) -> Mapping[str, Any]:
        with self._lock:
            return self._pod

    def _deleting(self) -> bool:
        return bool(meta_of(self.pod).get("deletionTimestamp"))

    def _leaving(self) -> bool:
        return self._vanished or self._shutdown or self._deleting()

    def _facts(self) -> PodFacts:
        k = self.kubelet
        return PodFacts(self.pod_ip, k.address, k.node_name, k.allocatable)

    # -- what a container becomes -----------------------------------------------------------

    def _container_paths(self, slot: ContainerSlot) -> tuple[Path, Path, Path]:
        base = self.dir / "containers" / slot.name
        return base / "termination-log", base / "host-memory.json", base / f"{slot.instance}.log"

    def _path_map(self, slot: ContainerSlot, termination_file: Path) -> PathMap:
        mounts = []
        for m in slot.spec.get("volumeMounts") or []:
            vol = self.volumes.get(str(m["name"]))
            if vol is None:
                raise SpecError("CreateContainerConfigError", f'volume "{m["name"]}" not found in the pod')
            local = vol / m["subPath"] if m.get("subPath") else vol
            local.mkdir(parents=True, exist_ok=True)
            mounts.append((str(m["mountPath"]), str(local)))
        tpath = str(slot.spec.get("terminationMessagePath") or DEFAULT_TERMINATION_MESSAGE_PATH)
        return PathMap.build(mounts, [(tpath, str(termination_file))])

    def _launch_plan(self, slot: ContainerSlot) -> tuple[list[str], dict[str, str], Path]:
        k = self.kubelet
        termination_file, memory_file, _ = self._container_paths(slot)
        pm = self._path_map(slot, termination_file)
        pod_env = container_env(self.pod, slot.spec, self._facts(), k.api.lookup_key, k.api.lookup_object)
        argv = container_argv(slot.spec, k.image, pod_env)
        executable = resolve_executable(argv[0], k.image)
        slot.exec_path = executable
        env = {
            "PATH": f"{k.image_bin}:{IMAGE_PATH}",
            "HOME": str(self.dir / "home"),
            "HOSTNAME": self.pod_name,
            "LANG": "C.UTF-8",
        }
        if slot.gpus:
            env[VISIBLE_DEVICES_ENV] = ",".join(slot.gpus)
            env[simgpus.GPU_ROOT_ENV] = str(k.gpu_root)
        if k.scenario:
            env[SCENARIO_ENV] = k.scenario
        engine = image_engine_version(str(slot.spec.get("image", "")))
        if engine is not None:  # the release its fake vLLM (and its python's metadata) plays
            env[ENGINE_VERSION_ENV] = engine
        env[simgpus.IMEX_CHANNELS_GLOB_ENV] = self._imex_channels()
        env.update(k.extra_env)
        env.update(k.take_start_fault(slot.name))
        env[HOST_MEMORY_ENV] = str(memory_file)
        env.update({name: pm.env_value(value) for name, value in pod_env.items()})
        env[POD_IP_ENV] = self.pod_ip  # the "network namespace": not the pod spec's to change
        env[HOSTS_FILE_ENV] = str(k.hosts_file)  # its "resolv.conf": the cluster DNS (kube/dns.py)
        working = slot.spec.get("workingDir")
        cwd = Path(pm.path(str(working))) if working else self.dir / "rootfs"
        if not cwd.is_dir():
            cwd = self.dir / "rootfs"
        return [executable, *(pm.arg(a) for a in argv[1:])], env, cwd

    def _imex_channels(self) -> str:
        """The pod's IMEX channel folder's glob: a channel file when its node grants one (most
        clusters grant none: an IMEX channel comes from a ComputeDomain)."""
        folder = self.dir / "imex-channels"
        folder.mkdir(parents=True, exist_ok=True)
        channel = folder / "channel0"
        if self.kubelet.imex_channel:
            channel.touch()
        else:
            channel.unlink(missing_ok=True)
        return str(folder / "channel*")

    # -- starting, exiting, restarting, stopping ------------------------------------------

    def _start(self, slot: ContainerSlot, now: float) -> None:
        termination_file, memory_file, _ = self._container_paths(slot)
        termination_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            argv, env, cwd = self._launch_plan(slot)
        except SpecError as e:
            if e.reason == "StartError":
                self._start_failed(slot, e.message, now)
            else:
                slot.view.state, slot.view.waiting_reason, slot.view.waiting_message = (
                    "waiting",
                    e.reason,
                    e.message,
                )
                slot.restart_at = now + 1.0  # the kubelet retries config errors on its next sync
            return
        self.kubelet.set_comm_init(slot.gpus, argv)
        termination_file.write_bytes(b"")  # a fresh, empty file per container instance
        with contextlib.suppress(FileNotFoundError):
            memory_file.unlink()
        _, _, log_path = self._container_paths(slot)
        marker = f"{self.uid}/{slot.name}/{slot.instance}"
        try:
            proc = ContainerProcess(marker, argv, env, cwd, log_path)
        except OSError as e:
            self._start_failed(slot, f"failed to start container process: {e}", now)
            return
        slot.proc, slot.restart_at, slot.oom, slot.stop_deadline = proc, None, False, None
        v = slot.view
        v.state, v.started_at, v.container_id = "running", proc.started_at, f"rankguard-process://{proc.pid}"
        v.image_id = f"rankguard-image://{slot.exec_path}"
        v.waiting_reason, v.waiting_message, v.ready = "", "", False
        arm_probes(slot, proc.started_at, self.key)
        v.started = slot.startup is None
        log.info("pod %s: container %s started (pid %d)", self.key, slot.name, proc.pid)

    def _start_failed(self, slot: ContainerSlot, message: str, now: float) -> None:
        log.warning("pod %s: container %s cannot start: %s", self.key, slot.name, message)
        term = Termination(
            exit_code=128, reason="StartError", started_at=0.0, finished_at=now, message=message
        )
        self._record_exit(slot, term, now, run_seconds=0.0)

    def _exited(self, slot: ContainerSlot, ex: Exit, now: float) -> None:
        assert slot.proc is not None
        termination_file, _, log_path = self._container_paths(slot)
        try:
            file_bytes = termination_file.read_bytes()
        except OSError:
            file_bytes = b""
        policy = str(slot.spec.get("terminationMessagePolicy") or "File")
        log_bytes = b""
        if policy == "FallbackToLogsOnError" and ex.exit_code != 0 and not file_bytes:
            with contextlib.suppress(OSError):
                log_bytes = log_path.read_bytes()
        term = Termination(
            exit_code=ex.exit_code,
            reason=exit_reason(ex.exit_code, slot.oom),
            started_at=slot.proc.started_at,
            finished_at=now,
            message=termination_message(file_bytes, policy, ex.exit_code, log_bytes),
            container_id=slot.view.container_id,
            signal=ex.signal,
        )
        log.info(
            "pod %s: container %s exited: %s (exit code %d)", self.key, slot.name, term.reason, term.exit_code
        )
        run_seconds = now - slot.proc.started_at
        slot.proc = None
        slot.instance += 1
        slot.startup = slot.liveness = slot.readiness = None
        self._record_exit(slot, term, now, run_seconds)

    def _record_exit(self, slot: ContainerSlot, term: Termination, now: float, run_seconds: float) -> None:
        v = slot.view
        v.ready = v.started = False
        restart = not self._leaving() and (
            (self.restart_policy == "Always" and not slot.init)
            or (self.restart_policy != "Never" and term.exit_code != 0)
        )
        if not restart:
            v.state, v.terminated, slot.done = "terminated", term, True
            if slot.init and term.exit_code == 0:
                v.ready = True  # a completed init container reads ready, as the kubelet reports it
            return
        k = self.kubelet
        if run_seconds > 2 * k.backoff_cap:
            slot.crashes = 0  # it ran long enough for the kubelet to forget its back-off
        slot.crashes += 1
        delay = backoff_delay(slot.crashes, k.backoff_base, k.backoff_cap)
        v.earlier_terminated, v.last_terminated, v.terminated = v.last_terminated, term, None
        v.restart_count += 1
        v.state, v.waiting_reason = "waiting", "CrashLoopBackOff"
        v.waiting_message = crash_loop_message(delay, slot.name, self.pod_name, self.namespace, self.uid)
        slot.restart_at = now + delay

    def _cancel_restart(self, slot: ContainerSlot) -> None:
        """A container waiting out its back-off when the pod stops (deletion, disappearance)
        never starts again: as the kubelet, which restarts no container of a pod with a
        deletionTimestamp (ShouldContainerBeRestarted), it reads as its last run, terminated,
        no longer as CrashLoopBackOff with a restart to come."""
        v = slot.view
        slot.restart_at = None
        if slot.done or slot.proc is not None or v.state != "waiting" or v.last_terminated is None:
            return
        v.state, v.terminated, slot.done = "terminated", v.last_terminated, True
        v.last_terminated, v.earlier_terminated = v.earlier_terminated, None
        v.restart_count -= 1  # the restart it counted never happens
        v.waiting_reason, v.waiting_message = "", ""

    def _check_memory(self, slot: ContainerSlot) -> None:
        limit = memory_limit_bytes(slot.spec)
        if limit is None or slot.proc is None:
            return
        _, memory_file, _ = self._container_paths(slot)
        try:
            doc = json.loads(memory_file.read_bytes())
            rss = int(doc["rss_bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # not written yet, or mid-write: the next tick reads it again
        if rss > limit:
            log.info("pod %s: container %s OOM-killed (rss %d > limit %d)", self.key, slot.name, rss, limit)
            slot.oom = True
            slot.proc.kill_all()
            slot.proc.wait(5.0)

    def _grace(self) -> float:
        meta, spec = meta_of(self.pod), spec_of(self.pod)
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds")
        return float(min(30 if grace is None else grace, self.kubelet.grace_cap))

    def _request_stop(self, slot: ContainerSlot, grace: float, now: float) -> None:
        if slot.proc is None or slot.stop_deadline is not None:
            return
        slot.proc.signal_group(signal.SIGTERM)
        slot.stop_deadline = now + grace
