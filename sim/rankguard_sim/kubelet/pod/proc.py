"""One container instance as a local process, and the "cgroup" that finds all of its processes.

A container's main process runs in its own process group (its own session), with its
output appended to a log file. Programs inside may start their own sessions (the agent
runs vLLM that way), so the process group alone does not hold the container; every
process of a container instance instead carries RANKGUARD_SIM_CONTAINER=<id> in its
environment, which children inherit, and `container_pids` finds them through
/proc/<pid>/environ, as a cgroup would. When the main process exits, the rest are killed,
as a container's processes die with its PID 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rankguard_sim.kubelet")

CONTAINER_ENV = "RANKGUARD_SIM_CONTAINER"
_PR_SET_PDEATHSIG = 1

_prctl: Callable[..., int] | None
try:  # loaded once here so the child, between fork and exec, only calls a function
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_kubelet() -> None:  # runs in the child between fork and exec
    # A crashed kubelet must not leave containers behind (the parent-death signal is
    # tied to the forking thread, which in the kubelet outlives the container).
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def container_pids(container_id: str, proc: str = "/proc") -> list[int]:
    """Live processes whose environment marks them as part of `container_id`."""
    needle = f"{CONTAINER_ENV}={container_id}".encode()
    found = []
    try:
        entries = os.listdir(proc)
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue  # gone, or not ours to read
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


@dataclass(frozen=True)
class Exit:
    exit_code: int  # as a runtime reports it: 128 + N after signal N
    signal: int  # 0 when the process exited by itself


def exit_from_returncode(returncode: int) -> Exit:
    if returncode < 0:
        return Exit(128 - returncode, -returncode)
    return Exit(returncode, 0)


class ContainerProcess:
    """A running container instance. Not thread-safe: one pod worker owns it."""

    def __init__(
        self,
        container_id: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
    ) -> None:
        self.container_id = container_id
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**env, CONTAINER_ENV: container_id}
        with log_path.open("ab") as out:
            self._proc = subprocess.Popen(
                list(argv),
                env=full_env,
                cwd=str(cwd),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_kubelet,  # noqa: PLW1509 - one prctl call, no locks
            )
        self.pid = self._proc.pid
        self.started_at = time.time()
        self.exit: Exit | None = None

    def poll(self) -> Exit | None:
        if self.exit is None:
            rc = self._proc.poll()
            if rc is not None:
                self.exit = exit_from_returncode(rc)
                self.kill_all()  # whatever it left behind dies with it
        return self.exit

    def pids(self) -> list[int]:
        """Every live process of this container (the main one included while it runs)."""
        found = set(container_pids(self.container_id))
        if self.exit is None and self._proc.poll() is None:
            found.add(self.pid)
        return sorted(found)

    def signal_group(self, sig: int) -> None:
        if self.exit is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def kill_all(self) -> None:
        """SIGKILL the process group and every marked process (the container's "cgroup")."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in container_pids(self.container_id):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def wait(self, timeout: float) -> Exit | None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.poll()
