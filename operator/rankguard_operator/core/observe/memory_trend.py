"""Slow memory creep while serving: a bounded series of the tightest rank's headroom, its
least-squares slope, and when that slope would bring it down to the low-headroom line.

A vLLM that serves for hours can lose free GPU memory slowly (the caching allocator keeps what
a long batch reserved, fragmentation, a leak in a custom kernel or a sampler). No OOM says so
until the last straw. This module keeps what is needed to see it coming; the status shows it
(the MemoryCreep condition, core/status/creep) and the metrics export it. Nothing here decides
anything: the policy never reads it, and rankguard restarts nothing for a trend.

The series is carried in `status.memoryTrend`, so it survives an operator restart. It changes
at most once per `SAMPLE_EVERY_SECONDS` (and when it resets), and everything written from it
(the condition, the slope) is computed from the samples alone, so it adds at most one status
write per 5 minutes to a steady service.

Pure: no I/O, no clock (`now` is an argument).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.observe.headroom import Observation
from rankguard_operator.core.observe.pods import carried_template_hash, get_path

# --------------------------------------------------------------------------------------------
# Tunables. Each says why it has the value it has.

# One sample per 5 minutes: each is already the agent's minimum over its 60 s window (a load
# peak is in it), creep is a matter of hours, and the series is written to status whenever it
# takes a sample: 5 minutes keeps that at 12 writes an hour, well under the one-a-minute a steady
# service is allowed (issue 31).
SAMPLE_EVERY_SECONDS = 300.0
# Three hours kept, and fitted (at most 37 samples, about 1 KiB of status): 36 samples average
# the noise of single window minima out (the slope's error is about a fifth of a sample's per
# hour), while a creep that starts after hours of steady serving shows three quarters of its
# rate two hours in (a six-hour fit would show a quarter, and judge it hours later).
KEEP_SECONDS = 3 * 3600.0
MAX_SAMPLES = int(KEEP_SECONDS // SAMPLE_EVERY_SECONDS) + 1
# Judged only over at least an hour of samples: a burst of long prompts lowers the window minimum
# for minutes, and a fit over less would take it for a trend.
MIN_SPAN_SECONDS = 3600.0
MIN_SAMPLES = 3
# Creep is a fall of more than 2 % of the GPU an hour (1.6 GiB on an 80 GiB card): slower, a day
# of serving loses less than half the GPU, and the low-headroom rule's shrink is the answer.
CREEP_FALL_FRACTION_PER_HOUR = 0.02
# ... and the line must be within 12 hours at that rate: one on-call shift, time to plan a
# restart in a quiet hour rather than have the low-headroom rule shrink the budget at a peak.
CREEP_HORIZON_HOURS = 12.0
# Once said, creep is withdrawn only when the fall is under half the threshold or the line has
# gone beyond twice the horizon: a slope near the threshold, fitted over noisy samples, would
# otherwise flip the condition (and page) every few samples.
CLEAR_FALL_FRACTION_PER_HOUR = CREEP_FALL_FRACTION_PER_HOUR / 2
CLEAR_HORIZON_HOURS = 2 * CREEP_HORIZON_HOURS


# --------------------------------------------------------------------------------------------
# The series


@dataclass(frozen=True)
class MemoryTrend:
    """The tightest rank's headroom over time, for one set of serving processes.

    `key` names what the samples are of (the template and the pods running it, `serving_key`):
    a roll, a replaced pod or a scaled Deployment starts a new series. `samples` are (epoch
    seconds, bytes), oldest first; `rank` and `gpu_bytes` are the tightest rank and its GPU's
    total at the last sample."""

    key: str
    samples: tuple[tuple[float, int], ...] = ()
    rank: int | None = None
    gpu_bytes: int | None = None

    def to_status(self, line_bytes: int | None = None) -> dict[str, Any]:
        """`status.memoryTrend`; with `line_bytes` (the low-headroom line) also the fit's slope
        and projection, as figures for `kubectl get -o yaml` and the metrics."""
        doc: dict[str, Any] = {
            "servingKey": self.key,
            "samples": [[int(t), int(b)] for t, b in self.samples],
            "rank": self.rank,
            "gpuBytes": self.gpu_bytes,
            "bytesPerHour": None,
            "hoursToLine": None,
        }
        f = self.fitted
        if f is not None:
            doc["bytesPerHour"] = round(f.bytes_per_hour)
            if line_bytes is not None:
                hours = f.hours_to(line_bytes)
                doc["hoursToLine"] = None if hours is None else round(hours, 1)
        return doc

    @functools.cached_property
    def fitted(self) -> TrendFit | None:
        """`fit(self)`, once: a pass writes the slope into status and judges the condition from it."""
        return fit(self)

    @classmethod
    def from_status(cls, doc: Any) -> MemoryTrend | None:
        """None when absent or unreadable (status can be edited by hand: a malformed sample is
        dropped, never trusted)."""
        if not isinstance(doc, Mapping) or not isinstance(doc.get("servingKey"), str):
            return None
        samples: list[tuple[float, int]] = []
        raw = doc.get("samples")
        for s in raw if isinstance(raw, list) else ():
            readable = isinstance(s, list) and len(s) == 2 and all(_is_int(v) for v in s) and s[1] >= 0
            if readable and (not samples or s[0] > samples[-1][0]):  # oldest first, no repeats
                samples.append((float(s[0]), int(s[1])))
        return cls(
            key=doc["servingKey"],
            samples=tuple(samples[-MAX_SAMPLES:]),
            rank=doc["rank"] if _is_int(doc.get("rank")) and doc["rank"] >= 0 else None,
            gpu_bytes=doc["gpuBytes"] if _is_int(doc.get("gpuBytes")) and doc["gpuBytes"] > 0 else None,
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def serving_key(pods: Sequence[Mapping[str, Any]], template_hash: str | None) -> str | None:
    """What a series is of: the template in effect and the names of the pods that run it (not
    being deleted). A roll changes the template, a replaced or added pod the names; either way
    the processes are new and their headroom starts over. None without a template."""
    if not template_hash:
        return None
    names = sorted(
        str(get_path(p, "metadata", "name") or "")
        for p in pods
        if carried_template_hash(p) == template_hash and not get_path(p, "metadata", "deletionTimestamp")
    )
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]
    return f"{template_hash[:64]}/{digest}"


def track(
    prev: MemoryTrend | None,
    observation: Observation | None,
    *,
    key: str | None,
    now: float,
    restarted: bool,
) -> MemoryTrend | None:
    """The series after this pass. It starts over when `key` changes or a vLLM process ended
    (`restarted`: a new termination, an OOM among them), and when the clock went back; it takes
    a sample of the fresh bottleneck at most every SAMPLE_EVERY_SECONDS; stale or missing reports
    leave it as it was. A pass that starts it over takes no sample, so a termination listed again
    pass after pass leaves the series (and the status) unchanged."""
    if key is None:
        return None
    if prev is None or prev.key != key or restarted or (prev.samples and now < prev.samples[-1][0]):
        return MemoryTrend(key)
    b = observation.bottleneck if observation is not None else None
    if b is None:
        return prev
    if prev.samples and now - prev.samples[-1][0] < SAMPLE_EVERY_SECONDS:
        return prev
    kept = tuple(s for s in prev.samples if s[0] >= now - KEEP_SECONDS)
    samples = (*kept, (now, b.min_free_bytes))[-MAX_SAMPLES:]
    return MemoryTrend(key, samples, rank=b.rank, gpu_bytes=b.total_bytes or prev.gpu_bytes)


# --------------------------------------------------------------------------------------------
# The fit and the verdict


@dataclass(frozen=True)
class TrendFit:
    """The least-squares line through a series: its slope and its value at the last sample, and
    the slopes of the series' earlier and later halves (in time) apart."""

    samples: int
    span_seconds: float
    bytes_per_hour: float
    fitted_bytes: float  # the line's value at the last sample (less noisy than the sample)
    rank: int | None
    gpu_bytes: int | None
    halves: tuple[float, float] = (0.0, 0.0)  # bytes an hour, the earlier half's then the later's

    @property
    def a_step(self) -> bool:
        """One half of the series holds (almost) all of the fall: one step down, such as NCCL's
        buffers on the first traffic under TP (~4.5 GiB, vLLM PR #25359) or a new process on the
        GPU, not a steady fall. A least-squares line through a step is steep; each half's alone
        is flat on one side of it."""
        limit = -CLEAR_FALL_FRACTION_PER_HOUR * (self.gpu_bytes or 0)
        return any(h > limit for h in self.halves)

    def hours_to(self, line_bytes: int) -> float | None:
        """Hours until the line reaches `line_bytes` at this slope: 0 when it is already there,
        None when headroom is not falling."""
        if self.fitted_bytes <= line_bytes:
            return 0.0
        if self.bytes_per_hour >= 0:
            return None
        return (self.fitted_bytes - line_bytes) / -self.bytes_per_hour


def fit(trend: MemoryTrend | None) -> TrendFit | None:
    """The least-squares line through the samples; None until they span MIN_SPAN_SECONDS."""
    if trend is None or len(trend.samples) < MIN_SAMPLES:
        return None
    t0 = trend.samples[0][0]
    xs = [(t - t0) / 3600.0 for t, _ in trend.samples]  # hours from the first sample
    ys = [float(b) for _, b in trend.samples]
    span = trend.samples[-1][0] - t0
    if span < MIN_SPAN_SECONDS:
        return None
    slope, mean_x, mean_y = _least_squares(xs, ys)
    middle = xs[-1] / 2
    early = [(x, y) for x, y in zip(xs, ys, strict=True) if x <= middle]
    late = [(x, y) for x, y in zip(xs, ys, strict=True) if x >= middle]
    return TrendFit(
        samples=len(xs),
        span_seconds=span,
        bytes_per_hour=slope,
        fitted_bytes=mean_y + slope * (xs[-1] - mean_x),
        rank=trend.rank,
        gpu_bytes=trend.gpu_bytes,
        halves=(_half_slope(early, slope), _half_slope(late, slope)),
    )


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """(slope, mean x, mean y) of the least-squares line; xs must not all be equal."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx, mx, my


def _half_slope(points: Sequence[tuple[float, float]], whole: float) -> float:
    """One half's slope; the whole series' when a gap leaves the half under 3 samples."""
    if len(points) < MIN_SAMPLES:
        return whole
    return _least_squares([x for x, _ in points], [y for _, y in points])[0]


def creeping(f: TrendFit | None, line_bytes: int, *, was: bool) -> bool:
    """Creep: headroom falling faster than CREEP_FALL_FRACTION_PER_HOUR of the GPU, in both
    halves of the series (not `a_step`), reaching `line_bytes` within CREEP_HORIZON_HOURS.
    `was`: it was said last pass, and holds until the looser CLEAR_* bounds are crossed."""
    if f is None or not f.gpu_bytes:
        return False
    if not was and f.a_step:
        return False
    fraction = CLEAR_FALL_FRACTION_PER_HOUR if was else CREEP_FALL_FRACTION_PER_HOUR
    horizon = CLEAR_HORIZON_HOURS if was else CREEP_HORIZON_HOURS
    if f.bytes_per_hour > -fraction * f.gpu_bytes:
        return False
    hours = f.hours_to(line_bytes)
    return hours is not None and hours <= horizon
