"""A neighbour on a simulated GPU: another live process, outside any pod, holding memory there.

What vLLM 0.34 cannot see (its own warning lists "other processes sharing the GPU, including ones
that allocate on it later"): the neighbour holds `hold` bytes from its start and grows by each
step's bytes at that step's time, as a real process, under its own pid, with one allocation file
(tag `neighbour`), so every reader counts it as NVML would (used = reserved + Σ live processes,
docs/sim-world.md) and it vanishes from the readings when the process dies.

    python -m rankguard_sim.physics.neighbour --root ROOT --gpu GPU-… --hold 4GiB --grow 6GiB@30

`--grow BYTES@SECONDS` (repeatable) grows at that many wall-clock seconds after the start; a line
`grow BYTES` on its stdin grows at once (what a test does once the engine is serving), `set BYTES`
holds exactly that. Like a real process's cudaMalloc, it never takes more than the GPU has free:
what it wants beyond that it takes as memory frees up (a training job or a second server retrying),
so a grown neighbour eats the margin first, and the rest once the engine has died and let go.
It exits, and gives the memory back, on SIGTERM/SIGINT or when its stdin closes, so it dies with
whoever started it. `start_neighbour` starts one and waits until its
allocation is written; `Neighbour.grow` / `.stop` drive it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rankguard_sim.physics import gpus
from rankguard_sim.physics.scenario_data import ScenarioError, parse_bytes

TAG = "neighbour"
_POLL_S = 0.05


@dataclass(frozen=True)
class Growth:
    at_s: float  # seconds after the start
    nbytes: int


def parse_growth(text: str) -> Growth:
    """`6GiB@30` -> Growth(30.0, 6 GiB)."""
    size, sep, at = text.partition("@")
    if not sep:
        raise ValueError(f"expected BYTES@SECONDS, got {text!r}")
    try:
        return Growth(float(at), parse_bytes(size.strip(), "--grow"))
    except (ScenarioError, ValueError) as e:
        raise ValueError(f"--grow {text!r}: {e}") from None


def run(root: str, uuid: str, hold: int, steps: Sequence[Growth], *, commands: bool = True) -> int:
    """The neighbour's life in this process: hold, grow on schedule and on command, until told to
    stop (a signal or, with `commands`, stdin's end)."""
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    alloc = gpus.Allocation(root, uuid, TAG)
    alloc.set(0)
    want = hold
    started = time.monotonic()
    pending = sorted(steps, key=lambda g: g.at_s)
    try:
        while not stop:
            now = time.monotonic() - started
            while pending and pending[0].at_s <= now:
                want += pending.pop(0).nbytes
            take(alloc, want)
            if commands:
                stop, want = _read_command(want)
            else:
                time.sleep(_POLL_S)
    finally:
        alloc.release()
    return 0


def take(alloc: gpus.Allocation, want: int) -> int:
    """Hold `want` bytes, or as much more as the GPU has free now (less: give it back)."""
    if want <= alloc.bytes:
        return alloc.set(want)
    free = gpus.free_bytes(alloc.root, alloc.uuid)
    return alloc.set(alloc.bytes + min(want - alloc.bytes, free))


def _read_command(want: int) -> tuple[bool, int]:
    """One stdin line if one is ready (`grow N`, `set N`): (stdin has closed, the new want)."""
    ready, _, _ = select.select([sys.stdin], [], [], _POLL_S)
    if not ready:
        return False, want
    line = sys.stdin.readline()
    if not line:
        return True, want
    verb, _, arg = line.strip().partition(" ")
    with contextlib.suppress(ScenarioError, ValueError):
        if verb == "grow":
            return False, want + parse_bytes(arg.strip(), "grow")
        if verb == "set":
            return False, parse_bytes(arg.strip(), "set")
    return False, want


# ---------------------------------------------------------------------------------------------
# Starting one


@dataclass
class Neighbour:
    """A running neighbour process (`start_neighbour`)."""

    root: str
    uuid: str
    proc: subprocess.Popen[bytes]
    steps: tuple[Growth, ...] = field(default_factory=tuple)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def held(self) -> int:
        """What it holds on its GPU now (0 once it has gone)."""
        return gpus.process_bytes(self.root, self.uuid, self.pid)

    def _written(self) -> bool:
        return any(a.pid == self.pid for a in gpus.all_allocations(self.root, self.uuid))

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def grow(self, nbytes: int, timeout: float | None = 10.0) -> None:
        """Grow by `nbytes` now; returns once the allocation file says so (`timeout` None: at
        once, for a growth the GPU may not have free yet)."""
        want = self.held() + nbytes
        self._send(f"grow {nbytes}")
        if timeout is not None:
            self._wait(lambda: self.held() >= want, timeout, f"to grow to {want} bytes")

    def set(self, nbytes: int, timeout: float | None = 10.0) -> None:
        self._send(f"set {nbytes}")
        if timeout is not None:
            self._wait(lambda: self.held() == nbytes, timeout, f"to hold {nbytes} bytes")

    def _wait(self, done: object, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():  # type: ignore[operator]
            if self.proc.poll() is not None:
                raise RuntimeError(f"the neighbour (pid {self.pid}) exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the neighbour (pid {self.pid}) did not get {what}")
            time.sleep(0.02)

    def stop(self, timeout: float = 10.0) -> None:
        """End it (its memory goes with it). Safe twice."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        gpus.cleanup_dead(self.root)


def start_neighbour(
    root: str | os.PathLike[str],
    uuid: str,
    hold: int,
    steps: Sequence[Growth] = (),
    *,
    timeout: float = 10.0,
) -> Neighbour:
    """Start a neighbour on GPU `uuid` under `root` holding `hold` bytes, growing per `steps`;
    returns once its allocation is written (so a reading right after counts it)."""
    gpus.read_device(root, uuid)  # no such GPU: SimGpuError here, not in the child
    argv = [sys.executable, "-m", "rankguard_sim.physics.neighbour", "--root", str(root), "--gpu", uuid]
    argv += ["--hold", str(hold)]
    for g in steps:
        argv += ["--grow", f"{g.nbytes}@{g.at_s}"]
    env = dict(os.environ)
    sim_dir = str(Path(__file__).resolve().parents[2])  # sim/, so `-m` finds rankguard_sim
    env["PYTHONPATH"] = os.pathsep.join(p for p in (sim_dir, env.get("PYTHONPATH", "")) if p)
    expect = min(hold, gpus.free_bytes(root, uuid))  # what its first cudaMalloc can get
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    n = Neighbour(str(root), uuid, proc, tuple(steps))
    try:
        n._wait(lambda: n.held() >= expect and n._written(), timeout, "started")
    except BaseException:
        n.stop()
        raise
    return n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rankguard_sim.physics.neighbour", description=__doc__)
    parser.add_argument("--root", required=True, help="the simulated GPUs' root")
    parser.add_argument("--gpu", required=True, help="the GPU's UUID")
    parser.add_argument("--hold", default="0", help="bytes held from the start (e.g. 4GiB)")
    parser.add_argument("--grow", action="append", default=[], type=parse_growth, help="BYTES@SECONDS")
    parser.add_argument("--no-commands", action="store_true", help="ignore stdin (run until a signal)")
    args = parser.parse_args(argv)
    try:
        hold = parse_bytes(args.hold, "--hold")
    except ScenarioError as e:
        parser.error(str(e))
    return run(args.root, args.gpu, hold, args.grow, commands=not args.no_commands)


if __name__ == "__main__":
    sys.exit(main())
