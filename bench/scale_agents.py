"""The Running mode's agents (bench/operator_scale.py --running): the REAL agent's HTTP app,
one per pod IP, hundreds per process.

Each pod gets `rankguard_agent.server.build_app(AgentState(sampler=Sampler(backend, ...)))`,
as the agent container serves it, so whatever /report does (a plain GET today, a long-poll
tomorrow) is what the operator talks to. Only the GPUs are synthetic (`SynthBackend`): each
rank's free memory drifts a little around a base between readings, and one rank's can be told
to drop by a fixed amount at a known CLOCK_MONOTONIC time (system-wide on Linux, so the
parent compares it with its own watch's clock).

A subprocess serves a share of the IPs on one asyncio loop, one AppRunner and TCPSite per IP.
Its samplers are driven from ONE thread, not a thread each, and at `hz` (1 by default) rather
than the agent's 10: 1,000 pods x 8 ranks x 10 reads a second would swamp the bench's two
cores, which the operator under measurement shares. A dropped rank is sampled at once, so the
drop -> status lag does not include the bench's slower sampling.

The parent talks to each subprocess over its stdin/stdout, one JSON object a line:
{"cmd": "drop", "ip", "rank", "bytes"} -> {"at": monotonic}; {"cmd": "stats"} -> {"served": n}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import random
import resource
import select
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any

from aiohttp import web

from rankguard_agent.gpu import GpuReading, ProcessMemory, RankDevice
from rankguard_agent.sampler import Sampler
from rankguard_agent.server import AgentState, build_app
from rankguard_agent.wire.report import parse_report

SLOTS = 10  # the samplers are spread over this many slots per period: no burst of 8,000 reads


def running_ips(n: int) -> list[str]:
    """One address per pod in 127.1.0.0/16 (all of 127/8 is local on Linux), 250 per /24 so
    no address ends in .0 or .255, away from the report cohort's 127.0.1.x."""
    if not 0 <= n <= 250 * 256:
        raise ValueError(f"at most {250 * 256} pods in Running mode")
    return [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(n)]


class SynthBackend:
    """`GpuBackend` for one pod: `ranks` GPUs of `total` bytes, free around `base_free` with a
    uniform drift of +-`drift` bytes per reading, less what `drop` took from a rank."""

    name = "bench"
    simulated = False

    def __init__(
        self, tag: str, ranks: int, *, total: int, base_free: int, drift: int, rng: random.Random
    ) -> None:
        self.total, self.base_free, self.drift, self.rng = total, base_free, drift, rng
        self.devices = [RankDevice(r, f"GPU-bench-{tag}-{r}", "bench") for r in range(ranks)]
        self.dropped = [0] * ranks

    def ranks(self) -> list[RankDevice]:
        return list(self.devices)

    def read(self, rank: int) -> GpuReading:
        free = self.base_free - self.dropped[rank] + self.rng.randint(-self.drift, self.drift)
        return GpuReading(rank, self.devices[rank].uuid, self.total, self.total - free, free)

    def drop(self, rank: int, nbytes: int) -> None:
        self.dropped[rank] = nbytes

    def processes(self, rank: int) -> list[ProcessMemory] | None:
        return []

    def vmm_supported(self) -> bool | None:
        return None

    def communicator_init(self, rank: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        return None


# --------------------------------------------------------------------------- the subprocess


@dataclass
class Pod:
    backend: SynthBackend
    sampler: Sampler
    state: AgentState


@dataclass
class Child:
    pods: dict[str, Pod]
    hz: float
    served: int = 0  # /report responses (the loop thread writes, the control thread reads)
    urgent: queue.SimpleQueue[str] = field(default_factory=queue.SimpleQueue)
    wake: threading.Event = field(default_factory=threading.Event)

    def drive(self) -> None:
        """Every sampler's sample_once at `hz`, one slot of them every period / SLOTS; a pod
        whose rank just dropped is sampled at once (only this thread samples: no races)."""
        samplers = [p.sampler for p in self.pods.values()]
        step = 1.0 / self.hz / SLOTS
        slot, next_at = 0, time.monotonic()
        while True:
            while not self.urgent.empty():
                self.pods[self.urgent.get()].sampler.sample_once()
            now = time.monotonic()
            if now >= next_at:
                for s in samplers[slot::SLOTS]:
                    s.sample_once()
                slot = (slot + 1) % SLOTS
                next_at = max(next_at + step, time.monotonic())  # behind: skip, do not burst
            self.wake.wait(max(0.0, next_at - time.monotonic()))
            self.wake.clear()

    def command(self, line: str) -> dict[str, Any]:
        msg = json.loads(line)
        if msg["cmd"] == "drop":
            pod = self.pods[msg["ip"]]
            pod.backend.drop(int(msg["rank"]), int(msg["bytes"]))
            at = time.monotonic()
            self.urgent.put(msg["ip"])
            self.wake.set()
            return {"at": at}
        if msg["cmd"] == "stats":
            return {"served": self.served}
        return {"error": f"unknown command {msg['cmd']!r}"}


def counting(child: Child) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def count(
        request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        response = await handler(request)
        if request.path == "/report":
            child.served += 1
        return response

    return count


async def serve(child: Child, port: int) -> list[web.AppRunner]:
    runners = []
    for ip, pod in child.pods.items():
        app = build_app(pod.state)
        app.middlewares.append(counting(child))
        # access_log=None: 1,000 agents' access lines would cost more than the answers;
        # no limit on connections: a long-poll holds one per pod open.
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, ip, port).start()
        runners.append(runner)
    return runners


def child_main(cfg: argparse.Namespace) -> int:
    # One listening socket per pod plus one connection per pod (held open by a long-poll).
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    rng = random.Random(cfg.seed)
    pods = {}
    for ip in cfg.ips.split(","):
        backend = SynthBackend(
            ip, cfg.ranks, total=cfg.total, base_free=cfg.base_free, drift=cfg.drift, rng=rng
        )
        sampler = Sampler(backend, hz=cfg.hz, window_seconds=60.0)
        sampler.sample_once()  # figures from the first request on
        pods[ip] = Pod(backend, sampler, AgentState(sampler=sampler, backend_name="bench"))
    child = Child(pods, cfg.hz)
    loop = asyncio.new_event_loop()
    runners = loop.run_until_complete(serve(child, cfg.port))
    threading.Thread(target=child.drive, name="samplers", daemon=True).start()
    out_lock = threading.Lock()

    def reply(msg: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def control() -> None:
        for line in sys.stdin:  # EOF: the parent is done (or gone)
            try:
                reply(child.command(line))
            except Exception as e:  # a bad command is answered, never fatal
                reply({"error": f"{type(e).__name__}: {e}"})
        loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=control, name="control", daemon=True).start()
    reply({"ready": len(pods), "nofile": hard})
    loop.run_forever()
    for r in runners:
        with contextlib.suppress(Exception):
            loop.run_until_complete(r.cleanup())
    return 0


# ------------------------------------------------------------------------------ the parent


class AgentFleet:
    """The subprocesses serving every pod IP; `drop` and `served` talk to them."""

    def __init__(
        self,
        ips: list[str],
        port: int,
        *,
        ranks: int,
        total: int,
        base_free: int,
        drift: int,
        hz: float,
        procs: int,
        seed: int = 31,
    ) -> None:
        self.ips, self.port = ips, port
        self.args = [
            f"--port={port}", f"--ranks={ranks}", f"--total={total}", f"--base-free={base_free}",
            f"--drift={drift}", f"--hz={hz}",
        ]  # fmt: skip
        self.shares = [ips[i::procs] for i in range(max(1, min(procs, len(ips))))]
        self.seed = seed
        self.procs: list[subprocess.Popen[str]] = []
        self.owner: dict[str, int] = {ip: i for i, share in enumerate(self.shares) for ip in share}
        self._locks: list[threading.Lock] = []

    def start(self, timeout: float = 120.0) -> None:
        for i, share in enumerate(self.shares):
            cmd = [sys.executable, __file__, "--child", f"--seed={self.seed + i}", f"--ips={','.join(share)}"]
            p = subprocess.Popen(
                [*cmd, *self.args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
            )
            self.procs.append(p)
            self._locks.append(threading.Lock())
        deadline = time.monotonic() + timeout
        for p in self.procs:
            msg = self._read(p, deadline)
            if "ready" not in msg:
                raise RuntimeError(f"an agent process did not start: {msg}")
        # What is served must be what the operator accepts: one real GET through the app.
        url = f"http://{self.ips[0]}:{self.port}/report"
        with urllib.request.urlopen(url, timeout=10) as r:
            parse_report(r.read())

    @staticmethod
    def _read(p: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
        assert p.stdout is not None
        # One line per request, so nothing waits in the file's buffer when select says none.
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = p.stdout.readline() if ready else ""
        if not line:
            why = f"exited (rc {p.poll()})" if ready else "did not answer in time"
            raise RuntimeError(f"agent process {p.pid} {why}")
        return dict(json.loads(line))

    def _ask(self, i: int, msg: dict[str, Any]) -> dict[str, Any]:
        p = self.procs[i]
        stdin: IO[str] | None = p.stdin
        assert stdin is not None
        with self._locks[i]:
            stdin.write(json.dumps(msg) + "\n")
            stdin.flush()
            got = self._read(p, time.monotonic() + 30)
        if "error" in got:
            raise RuntimeError(f"agent process {p.pid}: {got['error']}")
        return got

    def drop(self, ip: str, rank: int, nbytes: int) -> float:
        """Take `nbytes` off the rank's free memory from now on; the monotonic time it did."""
        return float(
            self._ask(self.owner[ip], {"cmd": "drop", "ip": ip, "rank": rank, "bytes": nbytes})["at"]
        )

    def served(self) -> int:
        return sum(int(self._ask(i, {"cmd": "stats"})["served"]) for i in range(len(self.procs)))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                if p.stdin is not None:
                    p.stdin.close()  # EOF: the child stops its loop
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def main() -> int:
    ap = argparse.ArgumentParser(description="agent subprocess of bench/scale_agents.py")
    ap.add_argument("--child", action="store_true", required=True)
    ap.add_argument("--ips", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--base-free", type=int, required=True)
    ap.add_argument("--drift", type=int, required=True)
    ap.add_argument("--hz", type=float, required=True)
    ap.add_argument("--seed", type=int, default=31)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return child_main(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
