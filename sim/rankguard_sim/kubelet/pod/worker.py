"""One pod on the process kubelet's node, from admission to deletion (see kubelet.py).

A `PodWorker` thread owns its pod: it admits it (GPUs, loopback IP, folders), sets up
its volumes, runs the init containers in order and then the containers, restarts them
with back-off, runs their probes, enforces memory limits, writes the pod's status
whenever it changes, and on deletion stops every process (SIGTERM, grace period,
SIGKILL) before it gives the resources back and confirms the deletion. How a container
becomes processes, exits and restarts is pod/containers.py, the class it builds on.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kubernetes.client.rest import ApiException

from rankguard_sim.kubelet.pod.containers import ContainerSlot, PodContainers
from rankguard_sim.kubelet.pod.meta import TERMINAL_PHASES, spec_of
from rankguard_sim.kubelet.pod.node import PodNode
from rankguard_sim.kubelet.pod.proc import Exit
from rankguard_sim.kubelet.pod.spec import (
    GPU_RESOURCE,
    SpecError,
    device_count,
    gpu_count,
    pod_gpu_count,
    pod_mig_counts,
    resolve_executable,
)
from rankguard_sim.kubelet.pod.status import KUBELET_CONDITIONS, pod_phase, pod_status
from rankguard_sim.kubelet.pod.volumes import claim_path, claim_volume_name, volume_files
from rankguard_sim.kubelet.probes import ProbeSpec, check_http, check_tcp

log = logging.getLogger("rankguard_sim.kubelet")

TICK_SECONDS = 0.1
VOLUME_RETRY_SECONDS = 0.5


@runtime_checkable
class SliceNode(Protocol):
    """A node that also hands out MIG slices (the process kubelet, when it has a MigLayout)."""

    def acquire_slices(self, uid: str, wanted: Mapping[str, int]) -> dict[str, list[str]] | None: ...

    def free_slices(self, resource: str) -> list[str]: ...


class PodWorker(PodContainers):
    """Runs one pod from admission to deletion; the only writer of that pod's status."""

    def __init__(self, kubelet: PodNode, pod: Mapping[str, Any]) -> None:
        super().__init__(kubelet, pod)
        self._last_status: dict[str, Any] | None = None
        self._status_retry_at = 0.0
        self._status_backoff = 0.0
        self._admission_error: tuple[str, str] | None = None
        self._volumes_retry_at = 0.0
        self._mounting = ""  # the volume being set up (named in a FailedMount Event)
        self._events = kubelet.api.pod_events(kubelet.node_name)
        self.released = False

    # -- the loop -------------------------------------------------------------------------

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
            self.kubelet.worker_done(self.uid, self)

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
        if not self._admit_slices():
            return
        try:
            self.pod_ip = k.acquire_ip(self.uid)
        except SpecError as e:
            self._admission_error = (e.reason, e.message)
            return
        for sub in ("volumes", "home", "rootfs", "containers"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        log.info("pod %s: admitted with IP %s and %d GPU(s)", self.key, self.pod_ip, len(got))

    def _admit_slices(self) -> bool:
        """MIG slices per `nvidia.com/mig-<profile>` limit, after the container's whole GPUs."""
        wanted = pod_mig_counts(self.pod)
        if not wanted:
            return True
        k = self.kubelet
        got = k.acquire_slices(self.uid, wanted) if isinstance(k, SliceNode) else None
        if got is None:
            short = next(
                (r for r, n in wanted.items() if not isinstance(k, SliceNode) or n > len(k.free_slices(r))),
                next(iter(wanted)),
            )
            free = len(k.free_slices(short)) if isinstance(k, SliceNode) else 0
            self._admission_error = (
                "UnexpectedAdmissionError",
                f"Allocate failed due to requested number of devices unavailable for {short}. "
                f"Requested: {wanted[short]}, Available: {free}, which is unexpected",
            )
            log.warning("pod %s: %s", self.key, self._admission_error[1])
            return False
        for resource, uuids in got.items():
            self.gpus = [*self.gpus, *uuids]
            for slot in self.init_slots:
                slot.gpus = [*slot.gpus, *uuids[: device_count(slot.spec, resource)]]
            offset = 0
            for slot in self.slots:
                n = device_count(slot.spec, resource)
                slot.gpus = [*slot.gpus, *uuids[offset : offset + n]]
                offset += n
        return True

    def _ensure_volumes(self) -> None:
        """Set up every volume once; raises SpecError (kept ContainerCreating) until it can."""
        k = self.kubelet
        for vol in spec_of(self.pod).get("volumes") or []:
            name = str(vol["name"])
            if name in self.volumes:
                continue
            self._mounting = name
            if "hostPath" in vol:
                path = Path(vol["hostPath"]["path"])
                if vol["hostPath"].get("type") == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                self.volumes[name] = path
                continue
            if "persistentVolumeClaim" in vol:
                self.volumes[name] = self._claim_folder(vol["persistentVolumeClaim"])
                continue
            folder = self.dir / "volumes" / name
            folder.mkdir(parents=True, exist_ok=True)
            for rel, data in volume_files(
                self.pod, vol, self._facts(), k.api.lookup_object, k.api.service_account_token
            ).items():
                target = folder / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
            self.volumes[name] = folder

    def _claim_folder(self, source: Mapping[str, Any]) -> Path:
        """The folder of the PersistentVolume bound to the claim: shared by every pod that
        mounts it and kept across restarts, like a real PV. `readOnly` is not enforced (the
        sandbox has no mount namespace to make a folder read-only for one container)."""
        api, claim_name = self.kubelet.api, str(source.get("claimName", ""))
        claim = api.read_claim(self.namespace, claim_name)
        volume_name = claim_volume_name(self.namespace, claim_name, claim)
        assert claim is not None  # claim_volume_name raised otherwise
        path = claim_path(self.namespace, claim, api.read_volume(volume_name))
        path.mkdir(parents=True, exist_ok=True)
        return path

    # -- driving the containers ---------------------------------------------------------

    def _step(self, now: float) -> None:
        if now < self._volumes_retry_at:
            return
        try:
            self._ensure_volumes()
        except (SpecError, ApiException, OSError) as e:
            # As the real kubelet: the containers wait in ContainerCreating (or PodInitializing)
            # with no message, and the reason is a Warning Event on the pod, counted per repeat.
            why = e.message if isinstance(e, SpecError) else str(e)
            message = f'MountVolume.SetUp failed for volume "{self._mounting}" : {why}'
            self._events.warn(self.pod, "FailedMount", message, now)
            self.kubelet.warn_throttled("pod %s: volumes not ready: %s", self.key, message)
            self._volumes_retry_at = now + VOLUME_RETRY_SECONDS  # as the kubelet's volume manager retries
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

    def _drive(self, slot: ContainerSlot, now: float) -> None:
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

    # -- probes -------------------------------------------------------------------------

    def _probe(self, slot: ContainerSlot, now: float) -> None:
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

    def _check(self, slot: ContainerSlot, spec: ProbeSpec) -> tuple[bool, str]:
        if spec.kind == "httpGet":
            return check_http(spec, self.pod_ip)
        if spec.kind == "tcpSocket":
            return check_tcp(spec, self.pod_ip)
        if spec.kind == "exec":
            return self._exec_probe(slot, spec)
        return False, f"{spec.kind} probes are not supported by the rankguard process kubelet"

    def _exec_probe(self, slot: ContainerSlot, spec: ProbeSpec) -> tuple[bool, str]:
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

    def _probe_kill(self, slot: ContainerSlot, which: str, message: str, now: float) -> None:
        log.info(
            "pod %s: container %s failed %s probe, will be restarted: %s",
            self.key,
            slot.name,
            which.lower(),
            message,
        )
        self._request_stop(slot, self._grace(), now)

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
            self.kubelet.api.patch_status(self.namespace, self.pod_name, self.uid, status)
        except ApiException as e:
            gone = e.status in (409, 422) and not self.kubelet.api.pod_exists(
                self.namespace, self.pod_name, self.uid
            )
            if e.status == 404 or gone:
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
            self._cancel_restart(slot)
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
            self.kubelet.api.confirm_deletion(self.pod)

    def _release(self) -> None:
        if self.released:
            return
        self.kill_everything()
        self.released = True
        self.kubelet.release_pod(self.uid)
