"""The sampler: reads every rank ~10 times a second and keeps the minimum free memory
over a sliding window, because the peaks that cause OOMs (a prefill burst, a sampler
tensor) last milliseconds to seconds and a single reading would miss them.

It runs in its own thread: an NVML call on a GPU that is falling off the bus can block
for seconds, and that must never stall the HTTP server. Readers take a snapshot under a
lock; the hot path does O(1) amortised work per rank per tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rankguard_agent.gpu import GpuBackend, GpuReading, RankDevice
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


class Sampler:
    def __init__(
        self,
        backend: GpuBackend,
        hz: float = DEFAULT_HZ,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if hz <= 0 or window_seconds <= 0:
            raise ValueError("hz and window_seconds must be positive")
        self.backend = backend
        self.period = 1.0 / hz
        self.window_seconds = window_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._states = [_RankState(d, WindowMin(window_seconds)) for d in backend.ranks()]
        self.samples_total = 0
        self.errors_total = 0
        self.ticks_total = 0
        self.last_tick: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._crashed: str | None = None

    # -- sampling ----------------------------------------------------------------------
    def sample_once(self) -> None:
        """Read every rank once. Never raises: a broken rank becomes that rank's error."""
        for state in self._states:
            rank = state.device.rank
            try:
                reading = self.backend.read(rank)
            except Exception as e:  # a backend bug must not end the sampling of other ranks
                reading = GpuReading(rank, state.device.uuid, 0, 0, 0, error=f"{type(e).__name__}: {e}"[:200])
            now = self._clock()
            with self._lock:
                previous = state.last
                state.last = reading
                if reading.error is None:
                    state.last_good = reading
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
                    )
                )
        return out
