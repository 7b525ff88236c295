"""The fake vLLM's sandbox side: what it does as a process in a pod, and reading its output back.

Not vLLM's behaviour but the sandbox's: the address a wildcard `--host` binds inside a pod
(`bind_address`: the pod IP, the stand-in for the pod's network namespace), the host memory
the process kubelet's OOMKilled decision reads (`HostMemoryReporter`), where the
engine's `import pynvml` comes from (`engine_pynvml_origin`, printed on a `rankguard-sim:`
line), and, for tests, reading a container log back: `engine_pynvml(log)` and
`weight_downloads(log)` (vLLM's own "Time spent downloading weights" lines, one per worker
that downloaded, rendered from the snapshot's template).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from rankguard_sim.physics.gpus import IMEX_CHANNELS_GLOB_ENV
from rankguard_sim.vllm_snapshot import message_pattern

POD_IP_ENV = "RANKGUARD_SIM_POD_IP"
WILDCARD_HOSTS = (None, "", "0.0.0.0", "::")
SIM_LINE = "rankguard-sim:"  # the sandbox's own lines in the fake's output (not vLLM's)
ENGINE_PYNVML = f"{SIM_LINE} engine pynvml:"
DOWNLOAD_MESSAGE = "weights_download_time"  # the snapshot's key for vLLM's download-time line
# Where an IMEX channel would be (vllm/utils/vmm_driver.py `_IMEX_CHANNELS`); the process kubelet
# points each pod at its own folder instead (IMEX_CHANNELS_GLOB_ENV; the agent reads it too)
IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels/channel*"


def imex_channel_available(env: Mapping[str, str]) -> bool:
    """vLLM's `imex_channel_available`: a channel file that this process can open (the file alone
    does not tell: a device cgroup may deny it), under the pod's glob."""
    for path in glob.glob(env.get(IMEX_CHANNELS_GLOB_ENV) or IMEX_CHANNELS):
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_RDONLY))
            return True
    return False


def bind_address(host: str | None, env: Mapping[str, str]) -> str:
    """What the server binds: the pod IP for a wildcard --host inside a pod, else the host."""
    pod_ip = env.get(POD_IP_ENV)
    if host in WILDCARD_HOSTS and pod_ip:
        return pod_ip
    return host or "0.0.0.0"


class HostMemoryReporter:
    """The engine's resident host memory, written where the process kubelet reads it for its
    OOMKilled decision (RANKGUARD_SIM_HOST_MEMORY_FILE; None: nowhere)."""

    def __init__(self, path: str | None, pid: int) -> None:
        self.path = Path(path) if path else None
        self.pid = pid
        self.peak = 0

    def report(self, rss_bytes: int) -> None:
        if self.path is None:
            return
        self.peak = max(self.peak, rss_bytes)
        doc = {"pid": self.pid, "rss_bytes": rss_bytes, "peak_rss_bytes": self.peak}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def engine_pynvml_origin() -> tuple[str, str]:
    """(the file `import pynvml` loads, "") or ("", why it cannot be imported)."""
    try:
        import pynvml  # noqa: PLC0415 - importing it the engine's way is the point
    except Exception as e:
        return "", f"{type(e).__name__}: {e}"
    return str(getattr(pynvml, "__file__", "") or ""), ""


def engine_pynvml(log: str) -> str | None:
    """From a fake vLLM's output: the engine's pynvml file ("" if it could not import it), or
    None when the line is not there."""
    for line in log.splitlines():
        if line.startswith(ENGINE_PYNVML):
            rest = line[len(ENGINE_PYNVML) :].strip()
            return "" if rest.startswith("not imported") else rest
    return None


def weight_downloads(log: str) -> list[tuple[str, float]]:
    """From a fake vLLM's (or real vLLM's) output: (model, seconds) of every "Time spent
    downloading weights" line, one per worker that downloaded; [] when none did."""
    pattern = message_pattern(DOWNLOAD_MESSAGE)
    found = []
    for line in log.splitlines():
        m = pattern.search(line)
        if m:
            found.append((m.group(1), float(m.group(2))))
    return found
