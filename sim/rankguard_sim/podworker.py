"""One pod on the process kubelet's node, from admission to deletion (see kubelet.py).

A `PodWorker` thread owns its pod: it admits it (GPUs, loopback IP, folders), sets up
its volumes, runs the init containers in order and then the containers, restarts them
with back-off, runs their probes, enforces memory limits, writes the pod's status
whenever it changes, and on deletion stops every process (SIGTERM, grace period,
SIGKILL) before it gives the resources back and confirms the deletion.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes.client.rest import ApiException

from . import gpus as simgpus
from .podproc import ContainerProcess, Exit
from .podspec import (
    DEFAULT_TERMINATION_MESSAGE_PATH,
    GPU_RESOURCE,
    PathMap,
    PodFacts,
    SpecError,
    backoff_delay,
    container_argv,
    container_env,
    gpu_count,
    memory_limit_bytes,
    pod_gpu_count,
    resolve_executable,
)
from .podstatus import (
    KUBELET_CONDITIONS,
    ContainerView,
    Termination,
    crash_loop_message,
    exit_reason,
    pod_phase,
    pod_status,
    termination_message,
)
from .podvolumes import volume_files
from .probes import ProbeSpec, ProbeTimer, check_http, check_tcp, parse_probe

if TYPE_CHECKING:
    from .kubelet import ProcessKubelet

log = logging.getLogger("rankguard_sim.kubelet")

HOST_MEMORY_ENV = "RANKGUARD_SIM_HOST_MEMORY_FILE"
SCENARIO_ENV = "RANKGUARD_SIM_SCENARIO"
TICK_SECONDS = 0.1
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TERMINAL_PHASES = ("Succeeded", "Failed")


def meta_of(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("metadata") or {}


def spec_of(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("spec") or {}


def pod_key(pod: Mapping[str, Any]) -> str:
    return f"{meta_of(pod).get('namespace')}/{meta_of(pod).get('name')}"


@dataclass
class _Slot:
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


class PodWorker(threading.Thread):
    """Runs one pod from admission to deletion; the only writer of that pod's status."""

    def __init__(self, kubelet: ProcessKubelet, pod: Mapping[str, Any]) -> None:
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
        self.slots: list[_Slot] = []
        self.init_slots: list[_Slot] = []
        self._last_status: dict[str, Any] | None = None
        self._status_retry_at = 0.0
        self._status_backoff = 0.0
        self._admission_error: tuple[str, str] | None = None
        self.released = False
        spec = spec_of(pod)
        self.restart_policy = str(spec.get("restartPolicy") or "Always")
        for c in spec.get("initContainers") or []:
            self.init_slots.append(
                _Slot(
                    c,
                    True,
                    ContainerView(c["name"], str(c.get("image", "")), waiting_reason="PodInitializing"),
                )
            )
        first = "PodInitializing" if self.init_slots else "ContainerCreating"
        for c in spec.get("containers") or []:
            self.slots.append(
                _Slot(c, False, ContainerView(c["name"], str(c.get("image", "")), waiting_reason=first))
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

    # -- the loop -------------------------------------------------------------------------

    @property
    def pod(self) -> Mapping[str, Any]:
        with self._lock:
            return self._pod

    def _deleting(self) -> bool:
        return bool(meta_of(self.pod).get("deletionTimestamp"))

    def _leaving(self) -> bool:
        return self._vanished or self._shutdown or self._deleting()

    def run(self) -> None:
        try:
            self._admit()
            while not self._leaving():
                now = time.time()
                if self._admission_error is None and not self._terminal():
                    self._step(now)
                self._sync_status(now)
                if self._terminal():
                    self._release()
                self._wake.wait(TICK_SECONDS)
                self._wake.clear()
            self._terminate()
        except Exception:
            log.exception("pod %s: worker failed; killing its containers", self.key)
            self.kill_everything()
            self._release()
        finally:
            self.kubelet.worker_done(self)

    # -- admission and set-up -----------------------------------------------------------

    def _admit(self) -> None:
        k = self.kubelet
        need = pod_gpu_count(self.pod)
        got = k.acquire_gpus(self.uid, need)
        if got is None:
            free = len(k.free_gpus())
            self._admission_error = (
                "UnexpectedAdmissionError",
                f"Allocate failed due to requested number of devices unavailable for {GPU_RESOURCE}. "
                f"Requested: {need}, Available: {free}, which is unexpected",
            )
            log.warning("pod %s: %s", self.key, self._admission_error[1])
            return
        self.gpus = got
        for slot in self.init_slots:
            slot.gpus = got[: gpu_count(slot.spec)]
        offset = 0
        for slot in self.slots:
            n = gpu_count(slot.spec)
            slot.gpus = got[offset : offset + n]
            offset += n
        try:
            self.pod_ip = k.acquire_ip(self.uid)
        except SpecError as e:
            self._admission_error = (e.reason, e.message)
            return
        for sub in ("volumes", "home", "rootfs", "containers"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        log.info("pod %s: admitted with IP %s and %d GPU(s)", self.key, self.pod_ip, len(got))

    def _facts(self) -> PodFacts:
        k = self.kubelet
        return PodFacts(self.pod_ip, k.address, k.node_name, k.allocatable)

    def _ensure_volumes(self) -> None:
        """Set up every volume once; raises SpecError (kept ContainerCreating) until it can."""
        k = self.kubelet
        for vol in spec_of(self.pod).get("volumes") or []:
            name = str(vol["name"])
            if name in self.volumes:
                continue
            if "hostPath" in vol:
                path = Path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                self.volumes[name] = path
                continue
            folder = self.dir / "volumes" / name
            folder.mkdir(parents=True, exist_ok=True)
            for rel, data in volume_files(
                self.pod, vol, self._facts(), k.lookup_object, k.service_account_token
            ).items():
                target = folder / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            self.volumes[name] = folder

    # -- running containers -----------------------------------------------------------------

    def _step(self, now: float) -> None:
        try:
            self._ensure_volumes()
        except (SpecError, ApiException, OSError) as e:
            message = e.message if isinstance(e, SpecError) else str(e)
            for slot in [*self.init_slots, *self.slots]:
                if slot.proc is None and not slot.done and slot.view.last_terminated is None:
                    slot.view.waiting_message = message
            self.kubelet.warn_throttled("pod %s: volumes not ready: %s", self.key, message)
            return
        if any(s.done and s.view.terminated and s.view.terminated.exit_code != 0 for s in self.init_slots):
            return  # an init container failed for good (restartPolicy Never): the pod has failed
        pending_init = next((s for s in self.init_slots if not s.done), None)
        if pending_init is not None:
            self._drive(pending_init, now)
            if (
                pending_init.done
                and pending_init.view.terminated
                and pending_init.view.terminated.exit_code == 0
            ):
                self._wake.set()  # the next one starts without waiting a tick
            return
        for slot in self.slots:
            self._drive(slot, now)

    def _drive(self, slot: _Slot, now: float) -> None:
        if slot.done:
            return
        if slot.proc is None:
            if slot.restart_at is None or now >= slot.restart_at:
                self._start(slot, now)
            return
        ex = slot.proc.poll()
        if ex is None:
            self._check_memory(slot)
            ex = slot.proc.poll()
        if ex is not None:
            self._exited(slot, ex, time.time())
            return
        if slot.stop_deadline is not None:
            if now >= slot.stop_deadline:
                slot.proc.kill_all()
            return
        self._probe(slot, now)

    def _container_paths(self, slot: _Slot) -> tuple[Path, Path, Path]:
        base = self.dir / "containers" / slot.name
        return base / "termination-log", base / "host-memory.json", base / f"{slot.instance}.log"

    def _path_map(self, slot: _Slot, termination_file: Path) -> PathMap:
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

    def _launch_plan(self, slot: _Slot) -> tuple[list[str], dict[str, str], Path]:
        k = self.kubelet
        termination_file, memory_file, _ = self._container_paths(slot)
        pm = self._path_map(slot, termination_file)
        pod_env = container_env(self.pod, slot.spec, self._facts(), k.lookup_key, k.lookup_object)
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
            env[simgpus.VISIBLE_DEVICES_ENV] = ",".join(slot.gpus)
            env[simgpus.GPU_ROOT_ENV] = str(k.gpu_root)
        if k.scenario:
            env[SCENARIO_ENV] = k.scenario
        env.update(k.extra_env)
        env.update(k.take_start_fault(slot.name))
        env[HOST_MEMORY_ENV] = str(memory_file)
        env.update({name: pm.env_value(value) for name, value in pod_env.items()})
        working = slot.spec.get("workingDir")
        cwd = Path(pm.path(str(working))) if working else self.dir / "rootfs"
        if not cwd.is_dir():
            cwd = self.dir / "rootfs"
        return [executable, *(pm.arg(a) for a in argv[1:])], env, cwd

    def _start(self, slot: _Slot, now: float) -> None:
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
        self.kubelet.set_comm_init(slot.gpus)
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
        self._arm_probes(slot, proc.started_at)
        v.started = slot.startup is None
        log.info("pod %s: container %s started (pid %d)", self.key, slot.name, proc.pid)

    def _arm_probes(self, slot: _Slot, started_at: float) -> None:
        def timer(key: str, initial: bool) -> ProbeTimer | None:
            probe = slot.spec.get(key)
            if not probe or slot.init:
                return None
            try:
                return ProbeTimer(parse_probe(probe, slot.spec), started_at, initial)
            except SpecError as e:
                log.warning("pod %s: container %s: %s ignored: %s", self.key, slot.name, key, e.message)
                return None

        slot.startup = timer("startupProbe", False)
        slot.liveness = timer("livenessProbe", True)
        slot.readiness = timer("readinessProbe", False)

    def _start_failed(self, slot: _Slot, message: str, now: float) -> None:
        log.warning("pod %s: container %s cannot start: %s", self.key, slot.name, message)
        term = Termination(
            exit_code=128, reason="StartError", started_at=0.0, finished_at=now, message=message
        )
        self._record_exit(slot, term, now, run_seconds=0.0)

    def _exited(self, slot: _Slot, ex: Exit, now: float) -> None:
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

    def _record_exit(self, slot: _Slot, term: Termination, now: float, run_seconds: float) -> None:
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
        v.last_terminated, v.terminated = term, None
        v.restart_count += 1
        v.state, v.waiting_reason = "waiting", "CrashLoopBackOff"
        v.waiting_message = crash_loop_message(delay, slot.name, self.pod_name, self.namespace, self.uid)
        slot.restart_at = now + delay

    def _check_memory(self, slot: _Slot) -> None:
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

    def _probe(self, slot: _Slot, now: float) -> None:
        v = slot.view
        if slot.startup is not None and not slot.startup.result:
            timer = slot.startup
            if timer.due(now):
                ok, msg = self._check(slot, timer.spec)
                timer.record(ok, now, msg)
                if timer.failed_out:
                    self._probe_kill(slot, "Startup", msg, now)
                    return
            v.started = timer.result
            if not v.started:
                return
        v.started = True
        if slot.liveness is not None and slot.liveness.due(now):
            ok, msg = self._check(slot, slot.liveness.spec)
            if slot.liveness.record(ok, now, msg) and not slot.liveness.result:
                self._probe_kill(slot, "Liveness", msg, now)
                return
        if slot.readiness is not None and slot.readiness.due(now):
            ok, msg = self._check(slot, slot.readiness.spec)
            slot.readiness.record(ok, now, msg)
        v.ready = slot.readiness.result if slot.readiness is not None else True

    def _check(self, slot: _Slot, spec: ProbeSpec) -> tuple[bool, str]:
        if spec.kind == "httpGet":
            return check_http(spec, self.pod_ip)
        if spec.kind == "tcpSocket":
            return check_tcp(spec, self.pod_ip)
        if spec.kind == "exec":
            return self._exec_probe(slot, spec)
        return False, f"{spec.kind} probes are not supported by the rankguard process kubelet"

    def _exec_probe(self, slot: _Slot, spec: ProbeSpec) -> tuple[bool, str]:
        if not spec.command:
            return False, "exec probe without a command"
        try:
            executable = resolve_executable(spec.command[0], self.kubelet.image)
            _, env, cwd = self._launch_plan(slot)
        except SpecError as e:
            return False, e.message
        try:
            r = subprocess.run(
                [executable, *spec.command[1:]],
                env=env,
                cwd=cwd,
                capture_output=True,
                timeout=spec.timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return False, f"command timed out after {spec.timeout:g}s"
        except OSError as e:
            return False, str(e)
        return r.returncode == 0, r.stdout.decode(errors="replace")[-1024:]

    def _probe_kill(self, slot: _Slot, which: str, message: str, now: float) -> None:
        log.info(
            "pod %s: container %s failed %s probe, will be restarted: %s",
            self.key,
            slot.name,
            which.lower(),
            message,
        )
        self._request_stop(slot, self._grace(), now)

    def _grace(self) -> float:
        meta, spec = meta_of(self.pod), spec_of(self.pod)
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = spec.get("terminationGracePeriodSeconds")
        return float(min(30 if grace is None else grace, self.kubelet.grace_cap))

    def _request_stop(self, slot: _Slot, grace: float, now: float) -> None:
        if slot.proc is None or slot.stop_deadline is not None:
            return
        slot.proc.signal_group(signal.SIGTERM)
        slot.stop_deadline = now + grace

    # -- status -------------------------------------------------------------------------------

    def _terminal(self) -> bool:
        if self._admission_error is not None:
            return True
        views = [s.view for s in self.slots]
        return pod_phase([s.view for s in self.init_slots], views, self.restart_policy) in TERMINAL_PHASES

    def _build_status(self, now: float, terminal: bool = False) -> dict[str, Any]:
        observed = (self.pod.get("status") or {}).get("conditions") or []
        mine = (self._last_status or {}).get("conditions") or []
        previous = [c for c in mine if c.get("type") in KUBELET_CONDITIONS]
        previous += [c for c in observed if c.get("type") not in KUBELET_CONDITIONS]
        status = pod_status(
            init=[s.view for s in self.init_slots],
            containers=[s.view for s in self.slots],
            restart_policy=self.restart_policy,
            pod_ip=self.pod_ip,
            host_ip=self.kubelet.address,
            start_time=self.start_time,
            now=now,
            previous_conditions=previous,
            sandbox_ready=bool(self.pod_ip) and not terminal,
            terminal=terminal,
        )
        if self._admission_error is not None:
            status["phase"] = "Failed"
            status["reason"], status["message"] = self._admission_error
        return status

    def _sync_status(self, now: float, terminal: bool = False, force: bool = False) -> None:
        if self._vanished or self._shutdown:
            return
        status = self._build_status(now, terminal)
        if status == self._last_status or (now < self._status_retry_at and not force):
            return
        try:
            self.kubelet.patch_status(self.namespace, self.pod_name, self.uid, status)
        except ApiException as e:
            if e.status == 404 or (e.status in (409, 422) and not self.kubelet.pod_exists(self)):
                self._vanished = True  # gone, or the name now belongs to a new pod
                return
            self._back_off_status(now)
            self.kubelet.warn_throttled(
                "pod %s: status update failed (%s %s), retrying", self.key, e.status, (e.body or "")[:300]
            )
            return
        except Exception as e:  # connection trouble: the API server may be restarting
            self._back_off_status(now)
            self.kubelet.warn_throttled("pod %s: status update failed (%s), retrying", self.key, e)
            return
        self._last_status = status
        self._status_backoff = 0.0

    def _back_off_status(self, now: float) -> None:
        self._status_backoff = min(max(0.2, self._status_backoff * 2), 5.0)
        self._status_retry_at = now + self._status_backoff

    # -- leaving ------------------------------------------------------------------------------

    def _terminate(self) -> None:
        """Deletion, disappearance or kubelet stop: SIGTERM, grace period, SIGKILL, clean up."""
        quick = self._vanished or self._shutdown
        grace = min(self._grace(), self.kubelet.stop_grace) if quick else self._grace()
        now = time.time()
        live = [s for s in [*self.init_slots, *self.slots] if s.proc is not None]
        for slot in live:
            slot.stop_deadline = None
            self._request_stop(slot, grace, now)
        for slot in [*self.init_slots, *self.slots]:
            slot.restart_at = None
        deadline = now + grace
        while any(s.proc is not None and s.proc.poll() is None for s in live) and time.time() < deadline:
            time.sleep(0.05)
        for slot in live:
            if slot.proc is not None:
                slot.proc.kill_all()
                ex = slot.proc.wait(5.0) or Exit(137, signal.SIGKILL)
                self._exited(slot, ex, time.time())
        log.info(
            "pod %s: stopped (%s)",
            self.key,
            "vanished" if self._vanished else "deleted" if not quick else "kubelet stop",
        )
        if not quick:
            self._sync_status(time.time(), terminal=True, force=True)
        self._release()
        if not quick:
            self.kubelet.confirm_deletion(self.pod)

    def kill_everything(self) -> None:
        for slot in [*self.init_slots, *self.slots]:
            if slot.proc is not None:
                slot.proc.kill_all()
                slot.proc.wait(5.0)

    def _release(self) -> None:
        if self.released:
            return
        self.kill_everything()
        self.released = True
        self.kubelet.release_pod(self.uid)
