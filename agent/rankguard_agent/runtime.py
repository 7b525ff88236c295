"""The long-running pieces together: GPU backend, sampler thread, state and HTTP server.

Both `serve` and `launch` run one. Nothing here may take the engine down: a backend that
cannot start leaves an agent with no ranks (and says why in /healthz and the log), and a
port that cannot be bound leaves an agent without a server.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from rankguard_agent.constants import DEFAULT_HOST, DEFAULT_PORT
from rankguard_agent.gpu import (
    GpuBackend,
    GpuUnavailable,
    NoGpuBackend,
    imex_channel,
    open_backend,
)
from rankguard_agent.others import PodProcesses
from rankguard_agent.sampler import DEFAULT_HZ, DEFAULT_WINDOW_SECONDS, Sampler
from rankguard_agent.server import AgentServer, AgentState, const_labels_from_env

log = logging.getLogger("rankguard_agent")


@dataclass(frozen=True)
class RuntimeConfig:
    backend: str = "auto"
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    window_seconds: float = DEFAULT_WINDOW_SECONDS
    hz: float = DEFAULT_HZ


def open_backend_or_none(kind: str, env: Mapping[str, str]) -> tuple[GpuBackend, str | None]:
    try:
        backend = open_backend(kind, env)
    except GpuUnavailable as e:
        log.error("GPU backend %r unavailable, serving without GPU readings: %s", kind, e)
        return NoGpuBackend(str(e)), str(e)
    for w in getattr(backend, "warnings", []):
        log.warning("%s", w)
    return backend, None


class AgentRuntime:
    def __init__(
        self,
        cfg: RuntimeConfig,
        env: Mapping[str, str],
        backend: GpuBackend | None = None,
        pod: PodProcesses | None = None,
    ) -> None:
        """`pod`: the pod's processes (the launcher's: the agent and the engine it starts), which
        lets the sampler measure the memory of everyone else on the GPUs; None under `serve`."""
        self.cfg = cfg
        self.env = dict(env)
        if backend is None:
            backend, error = open_backend_or_none(cfg.backend, env)
        else:
            error = None
        self.backend = backend
        self.sampler = Sampler(backend, hz=cfg.hz, window_seconds=cfg.window_seconds, pod=pod)
        self.state = AgentState(
            sampler=self.sampler,
            backend_name=backend.name,
            const_labels=const_labels_from_env(env),
            backend_error=error,
        )
        self.server = AgentServer(self.state, cfg.host, cfg.port)
        self.serving = False

    def read_driver(self) -> None:
        """What the driver offers vLLM 0.34's extensible KV cache (VMM, an IMEX channel), into
        the state. Asking libcuda takes a child process and can take seconds on a busy node, so
        `start` runs this in a thread of its own; the report says null until it is known."""
        try:
            self.state.imex_channel = imex_channel(self.backend, self.env)
            self.state.vmm = self.backend.vmm_supported()
        except Exception:  # never the agent's end: the fields stay unknown
            log.exception("reading the GPU driver's virtual memory support failed")

    def n_ranks(self) -> int:
        return len(self.backend.ranks())

    async def start(self) -> None:
        """Start sampling and serving. A port that cannot be bound is logged, not raised."""
        self.sampler.start()
        threading.Thread(target=self.read_driver, name="rankguard-driver", daemon=True).start()
        try:
            await self.server.start()
            self.serving = True
        except OSError as e:
            log.error(
                "cannot serve on %s:%s (%s); the agent keeps running without its API",
                self.cfg.host,
                self.cfg.port,
                e,
            )

    async def stop(self) -> None:
        await self.server.stop()
        self.sampler.stop()
        self.backend.close()
