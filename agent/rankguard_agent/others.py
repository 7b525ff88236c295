"""Who else holds memory on the pod's GPUs: what vLLM 0.34's extensible KV cache cannot see.

vLLM 0.34 sizes its KV cache from the memory free after warm-up, once; memory another process
takes on the same GPU later comes out of the headroom it kept for its own transients. So the
sampler measures, per rank and per tick, `others_bytes`: the GPU memory held by processes that
are not this pod's.

This pod's processes are the agent and its descendants: the engine the launcher started, the
workers the engine spawned (vLLM's multiprocessing executor starts them from its engine core,
itself a child of the API server), and the probe's ranks. A process is the pod's when its
parent chain (`/proc/<pid>/stat`) reaches the agent's pid. Why not /proc/<pid>/status NSpid: the
pids the driver lists are already the agent's own namespace's (NVIDIA's kernel module
translates each pid into the caller's pid namespace and leaves out the processes outside it,
which is why nvidia-smi shows none in a container), and a pid outside the namespace could not be
read from inside it anyway; the sandbox runs every pod in one namespace, where the parent chain
alone tells pods apart.

Because the driver leaves out other namespaces' processes, another pod's memory on a real GPU is
not in any list: it is what no listed process accounts for. So

    others_bytes = Σ listed processes that are not the pod's
                   + max(0, used − reserved − Σ every listed process)

(the second term is 0 in the sandbox, whose list is complete; on a real GPU it also holds what
the driver uses beyond `reserved`, which NVML v1 does not report). It is unknown (None) when a
process of the pod is listed without a figure (NVML_VALUE_NOT_AVAILABLE, e.g. under MIG) or the
list cannot be read, since the pod's own memory would then count as someone else's.

The memory reading and the process list are two calls: an engine that allocates between them
shows up for one tick as memory no process accounts for. So a rank reports the lesser of its
last two ticks (and the processes of that tick, or of the newer one when it lists none): a
neighbour's memory has to be there for two samples to count, and `others_peak_bytes` is never
raised by a race.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from rankguard_agent.gpu import GpuReading, ProcessMemory
from rankguard_agent.wire.report_memory import MAX_OTHERS, MAX_PROCESS_NAME, OtherProcess

_MAX_DEPTH = 64  # parent links followed before giving up (a pid chain is never this deep)
_CACHE_LIMIT = 256  # processes remembered; the list a GPU holds is a handful


@dataclass(frozen=True)
class ProcStat:
    """The three fields of /proc/<pid>/stat the classification needs."""

    ppid: int
    start: int  # start time in clock ticks since boot: tells a reused pid from the old process
    comm: str  # the process's name, as /proc/<pid>/comm says it


def read_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    """The process's stat, None when it is gone or not visible from here."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses; it ends at the last ")".
    open_at, close_at = raw.find("("), raw.rfind(")")
    rest = raw[close_at + 1 :].split()
    try:
        return ProcStat(ppid=int(rest[1]), start=int(rest[19]), comm=raw[open_at + 1 : close_at])
    except (IndexError, ValueError):
        return None


class PodProcesses:
    """Which pids are the pod's: `root` (the agent) and its descendants. A pid's answer is
    kept while the same process (same start time) holds that pid."""

    def __init__(self, root: int | None = None, proc: str = "/proc") -> None:
        self.root = os.getpid() if root is None else root
        self.proc = proc
        self._known: dict[int, tuple[int, bool, str]] = {}  # pid -> (start, the pod's, name)

    def identify(self, pid: int) -> tuple[bool, str]:
        """(whether the process is the pod's, its name: comm, else "pid N" when not visible)."""
        if pid == self.root:
            return True, self._name(pid)
        stat = read_stat(pid, self.proc)
        if stat is None:
            return False, f"pid {pid}"
        known = self._known.get(pid)
        if known is not None and known[0] == stat.start:
            return known[1], known[2]
        ours = self._descends(stat)
        name = (stat.comm or f"pid {pid}")[:MAX_PROCESS_NAME]
        if len(self._known) >= _CACHE_LIMIT:
            self._known.clear()  # processes come and go; the next tick re-learns the few it lists
        self._known[pid] = (stat.start, ours, name)
        return ours, name

    def _name(self, pid: int) -> str:
        stat = read_stat(pid, self.proc)
        return (stat.comm if stat is not None and stat.comm else f"pid {pid}")[:MAX_PROCESS_NAME]

    def _descends(self, stat: ProcStat) -> bool:
        parent: ProcStat | None = stat
        for _ in range(_MAX_DEPTH):
            if parent is None or parent.ppid <= 0:
                return False
            if parent.ppid == self.root:
                return True
            parent = read_stat(parent.ppid, self.proc)
        return False


@dataclass(frozen=True)
class OthersTick:
    """One tick's measure of a rank: others' bytes (None = unknown) and the largest few."""

    bytes: int | None
    top: tuple[OtherProcess, ...] = ()


def measure_others(
    reading: GpuReading, procs: Iterable[ProcessMemory] | None, pod: PodProcesses
) -> OthersTick:
    """Others' memory on the rank's GPU from one reading and the process list read just before
    it (None: the list could not be read)."""
    if procs is None or reading.error is not None:
        return OthersTick(None)
    listed = 0
    others: list[OtherProcess] = []
    unknown_own = False
    for p in procs:
        ours, name = pod.identify(p.pid)
        if p.used_bytes is None:
            unknown_own = unknown_own or ours
            continue  # another's memory without a figure stays in the remainder below
        listed += p.used_bytes
        if not ours:
            others.append(OtherProcess(p.pid, name, p.used_bytes))
    top = tuple(sorted(others, key=lambda o: (-o.bytes, o.pid))[:MAX_OTHERS])
    if unknown_own:
        return OthersTick(None, top)
    unaccounted = max(0, reading.used_bytes - reading.reserved_bytes - listed)
    return OthersTick(sum(o.bytes for o in others) + unaccounted, top)


class OthersTrack:
    """One rank's figures over ticks: the lesser of the last two ticks, and the most that has
    been since the agent started."""

    __slots__ = ("_last", "peak", "shown")

    def __init__(self) -> None:
        self._last: OthersTick | None = None
        self.shown = OthersTick(None)
        self.peak: int | None = None

    def push(self, tick: OthersTick) -> None:
        last, self._last = self._last, tick
        if last is None or last.bytes is None or tick.bytes is None:
            # Unknown until two readings in a row say it; the names may still be shown.
            self.shown = OthersTick(None, tick.top)
            return
        lesser = tick if tick.bytes <= last.bytes else last
        # A process that appears between a tick's list and its reading counts that tick only as
        # memory no process accounts for (unnamed); while it keeps growing, that older tick is
        # the lesser one, and the newer tick names it. (A process gone since leaves the newer
        # tick the lesser one, with no name to borrow.)
        self.shown = OthersTick(lesser.bytes, lesser.top or tick.top)
        shown = self.shown.bytes
        if shown is not None and (self.peak is None or shown > self.peak):
            self.peak = shown
