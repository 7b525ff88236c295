"""The sampler: reads every rank ~10 times a second and keeps the minimum free memory
over a sliding window, because the peaks that cause OOMs (a prefill burst, a sampler
tensor) last milliseconds to seconds and a single reading would miss them.

It runs in its own thread: an NVML call on a GPU that is falling off the bus can block
for seconds, and that must never stall the HTTP server. Readers take a snapshot under a
lock; the hot path does O(1) amortised work per rank per tick.

Given the pod's processes (`others.PodProcesses`, the launcher's), each tick also lists the
processes on every rank's GPU, just before reading its memory, and measures the memory held by
processes that are not the pod's (`others`): the process list is one more driver call (the sim's
is cached like its readings), one /proc/<pid>/stat read per listed process (is it still the
same process?), and its parent chain walked only when it is new.

When the engine begins loading weights (`mark_load`, the launcher's phase marker), each rank
keeps the free memory of its last reading and others' memory as shown then (`free_at_load_bytes`,
`others_at_load_bytes`): vLLM 0.34 sizes its KV cache against its worker's init memory snapshot,
taken just before, which it never prints (docs/agent.md). The last reading, not a fresh one: the
weights' tensors are allocated within milliseconds of the marker's print, so a read after the
line has come through the pipe is more likely to hold some of them than one from before it; and
no driver call is made on the launcher's event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rankguard_agent.gpu import GpuBackend, GpuReading, ProcessMemory, RankDevice
from rankguard_agent.others import OthersTick, OthersTrack, PodProcesses, measure_others
from rankguard_agent.wire.report import RankSample

log = logging.getLogger("rankguard_agent.sampler")

DEFAULT_HZ = 10.0
DEFAULT_WINDOW_SECONDS = 60.0


class WindowMin:
    """Minimum of the values pushed within the last `window` seconds.

    A monotonic deque: each value evicts the larger values before it (they can never be
    the minimum again while it is in the window), so push and min are amortised O(1) and
    the deque holds at most one entry per sample in the window.
    """

    __slots__ = ("_q", "window")

    def __init__(self, window: float) -> None:
        self.window = window
        self._q: deque[tuple[float, int]] = deque()

    def push(self, t: float, value: int) -> None:
        q = self._q
        while q and q[-1][1] >= value:
            q.pop()
        q.append((t, value))
        self.evict(t)

    def evict(self, now: float) -> None:
        q = self._q
        horizon = now - self.window
        # Keep the newest entry even when old: it is the last thing we know.
        while len(q) > 1 and q[0][0] < horizon:
            q.popleft()

    def min(self) -> int | None:
        return self._q[0][1] if self._q else None

    def __len__(self) -> int:
        return len(self._q)


@dataclass
class _RankState:
    device: RankDevice
    window: WindowMin
    last_good: GpuReading | None = None
    last: GpuReading | None = None
    others: OthersTrack | None = None  # with the pod's processes known
    last_good_at: float | None = None  # the clock when `last_good` was read
    # (free, others) when the engine began loading weights in this run; pending: the next reading's
    at_load: tuple[int, int | None] | None = None
    load_pending: bool = False


def listed_processes(backend: GpuBackend, rank: int) -> list[ProcessMemory] | None:
    """The processes on the rank's GPU; None when the backend cannot list them now."""
    try:
        return backend.processes(rank)
    except Exception:  # a backend bug costs this tick's others figure, nothing more
        return None


class Sampler:
    def __init__(
        self,
        backend: GpuBackend,
        hz: float = DEFAULT_HZ,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        pod: PodProcesses | None = None,
    ) -> None:
        if hz <= 0 or window_seconds <= 0:
            raise ValueError("hz and window_seconds must be positive")
        self.backend = backend
        self.period = 1.0 / hz
        self.window_seconds = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        # Others on the GPU are measured only where the pod's processes are known (the launcher's
        # agent is their root); `serve` reads an engine it did not start, and reports None.
        self.pod = pod
        self._states = [
            _RankState(d, WindowMin(window_seconds), others=None if pod is None else OthersTrack())
            for d in backend.ranks()
        ]
        self.samples_total = 0
        self.errors_total = 0
        self.ticks_total = 0
        self.last_tick: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._crashed: str | None = None
        self._others_failed = False

    # -- sampling ----------------------------------------------------------------------
    def sample_once(self) -> None:
        """Read every rank once. Never raises: a broken rank becomes that rank's error."""
        for state in self._states:
            rank = state.device.rank
            # Listed before the reading: see others.py on the two calls' race.
            procs = listed_processes(self.backend, rank) if self.pod is not None else None
            try:
                reading = self.backend.read(rank)
            except Exception as e:  # a backend bug must not end the sampling of other ranks
                reading = GpuReading(rank, state.device.uuid, 0, 0, 0, error=f"{type(e).__name__}: {e}"[:200])
            tick = self._others(reading, procs)
            now = self._clock()
            with self._lock:
                if state.others is not None and tick is not None:
                    state.others.push(tick)
                previous = state.last
                state.last = reading
                if reading.error is None:
                    state.last_good, state.last_good_at = reading, now
                    if state.load_pending:
                        state.load_pending, state.at_load = False, self._at_load(state, reading)
                    state.window.push(now, reading.free_bytes)
                    self.samples_total += 1
                else:
                    state.window.evict(now)
                    self.errors_total += 1
            # Log transitions only: a lost GPU must not write ten lines a second forever.
            if reading.error is not None and (previous is None or previous.error != reading.error):
                log.error("rank %d (%s): %s", rank, state.device.uuid or "?", reading.error)
            elif reading.error is None and previous is not None and previous.error is not None:
                log.warning("rank %d (%s): readings are back", rank, state.device.uuid or "?")
        with self._lock:
            self.ticks_total += 1
            self.last_tick = self._clock()

    def _others(self, reading: GpuReading, procs: list[ProcessMemory] | None) -> OthersTick | None:
        """This tick's measure of others on the rank's GPU; None: no measure (no pod, or a
        failed reading, which keeps the figures as they were)."""
        if self.pod is None or reading.error is not None:
            return None
        try:
            return measure_others(reading, procs, self.pod)
        except Exception:  # reading /proc must never stop the sampler
            if not self._others_failed:  # once: a broken /proc must not write ten lines a second
                self._others_failed = True
                log.exception("measuring the other processes on rank %d's GPU failed", reading.rank)
            return OthersTick(None)

    def _run(self) -> None:
        next_at = self._clock()
        try:
            while not self._stop.is_set():
                self.sample_once()
                next_at += self.period
                now = self._clock()
                if next_at < now:
                    # Fell behind (a slow NVML call): skip the missed ticks, do not burst.
                    next_at = now + self.period
                self._stop.wait(next_at - now)
        except BaseException as e:  # pragma: no cover - sample_once already contains errors
            self._crashed = f"{type(e).__name__}: {e}"
            log.exception("sampler stopped")

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="rankguard-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine's weights load -------------------------------------------------------
    @staticmethod
    def _at_load(state: _RankState, reading: GpuReading) -> tuple[int, int | None]:
        return reading.free_bytes, state.others.shown.bytes if state.others is not None else None

    def mark_load(self) -> None:
        """The engine began loading weights: every rank not yet marked in this engine run keeps
        its last reading's free memory (and others' memory as shown then); a rank without a good
        reading from the last tick or so (a failed or stuck read) takes its next good one.

        Every rank, not only the one whose line said so: vLLM logs the marker once per node
        (`info_once`, scope "local": the node's first rank), and its executor starts `load_model`
        on all of the node's workers at once."""
        now = self._clock()
        recent = max(2 * self.period, 0.5)
        with self._lock:
            for s in self._states:
                if s.at_load is not None or s.load_pending:
                    continue  # the first marker of the run: a later one may find weights loaded
                good, at = s.last_good, s.last_good_at
                if good is not None and s.last is good and at is not None and now - at <= recent:
                    s.at_load = self._at_load(s, good)
                else:
                    s.load_pending = True

    def at_load(self, rank: int) -> tuple[int | None, int | None, int | None]:
        """Local rank `rank`'s free memory and others' memory at this run's load start (None: not
        seen), and the most others have held on its GPU since the agent started, or hold now.

        Now: read when the engine has died, from the process list alone (each process named by
        its pid, none of the two-tick caution the remainder needs): a neighbour whose growth ran
        the engine out may have done so between two ticks."""
        if not 0 <= rank < len(self._states):
            return None, None, None
        named = self._named_others(self._states[rank].device.rank)
        with self._lock:
            s = self._states[rank]
            free, others = s.at_load if s.at_load is not None else (None, None)
            peak = s.others.peak if s.others is not None else None
        if named is not None:
            peak = named if peak is None else max(peak, named)
        return free, others, peak

    def _named_others(self, rank: int) -> int | None:
        if self.pod is None:
            return None
        procs = listed_processes(self.backend, rank)
        if procs is None:
            return None
        return sum(p.used_bytes or 0 for p in procs if not self.pod.identify(p.pid)[0])

    def reset_load(self) -> None:
        """A new engine run: what the last one's load start said no longer holds."""
        with self._lock:
            for s in self._states:
                s.at_load, s.load_pending = None, False

    # -- reading -----------------------------------------------------------------------
    def is_up(self) -> bool:
        """The sampler is running and has ticked recently (not stuck in a driver call)."""
        with self._lock:
            last = self.last_tick
        if self._crashed is not None or last is None:
            return False
        if self._thread is not None and not self._thread.is_alive():
            return False
        return self._clock() - last <= max(3 * self.period, 1.0)

    def last_sample_age(self) -> float | None:
        with self._lock:
            last = self.last_tick
        return None if last is None else max(0.0, self._clock() - last)

    def readings(self) -> list[GpuReading | None]:
        with self._lock:
            return [s.last for s in self._states]

    def snapshot(self) -> list[RankSample]:
        """Per-rank figures for /report. A failing rank keeps its last good figures."""
        now = self._clock()
        out = []
        with self._lock:
            for s in self._states:
                s.window.evict(now)
                good = s.last_good
                error = s.last.error if s.last is not None else "NoSample"
                if good is None:
                    total = used = free = min_free = 0
                else:
                    total, used, free = good.total_bytes, good.used_bytes, good.free_bytes
                    wmin = s.window.min()
                    min_free = free if wmin is None else min(wmin, free)
                others = s.others.shown if s.others is not None else OthersTick(None)
                free_at_load, others_at_load = s.at_load if s.at_load is not None else (None, None)
                out.append(
                    RankSample(
                        rank=s.device.rank,
                        uuid=s.device.uuid,
                        total_bytes=total,
                        used_bytes=used,
                        free_bytes=free,
                        min_free_bytes=min_free,
                        window_seconds=self.window_seconds,
                        error=error,
                        others_bytes=others.bytes,
                        others_peak_bytes=s.others.peak if s.others is not None else None,
                        others=list(others.top),
                        free_at_load_bytes=free_at_load,
                        others_at_load_bytes=others_at_load,
                    )
                )
        return out
