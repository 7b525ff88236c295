"""Slow memory creep while serving (core/observe/memory_trend, core/status/creep): the series of
the tightest rank's headroom (spacing, bounds, resets), its least-squares slope and projection,
the MemoryCreep condition (text, hysteresis), the gauges it exports, and, through the real step,
that it is said and never acted on, at one status write per sample."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rankguard_operator.core.conditions import Condition, condition, phase_for, set_condition
from rankguard_operator.core.effects import ApplyDeployment, PostEvent, WriteStatus
from rankguard_operator.core.names import TEMPLATE_HASH_ANNOTATION
from rankguard_operator.core.observe.headroom import Observation, RankHeadroom
from rankguard_operator.core.observe.memory_trend import (
    KEEP_SECONDS,
    MAX_SAMPLES,
    SAMPLE_EVERY_SECONDS,
    MemoryTrend,
    creeping,
    fit,
    serving_key,
    track,
)
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.status.creep import creep_event, memory_creep_condition
from rankguard_operator.core.status.figures import figures
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.units import GiB, MiB
from rankguard_operator.edge.metrics import SERVICE_GAUGES, forget_service
from tests.unit.reconcile_world import SPEC as WORLD_SPEC
from tests.unit.reconcile_world import Cluster, pod, report, running

T0 = 1_800_000_000.0
GPU = 80 * GiB
LINE = 256 * MiB  # the CRD's default spec.memory.minHeadroomBytes
SPEC = parse_spec({**WORLD_SPEC, "memory": {"gpuMemoryBytes": GPU, "minHeadroomBytes": LINE}})
HOUR = 3600.0


def observation(now: float, headroom: dict[int, int], *, stale: bool = False) -> Observation:
    return Observation(
        now=now,
        ranks=tuple(
            RankHeadroom(
                rank=r,
                uuid=f"GPU-{r}",
                pod="svc-0",
                total_bytes=GPU,
                free_bytes=h + GiB,
                min_free_bytes=h,
                stale=stale,
            )
            for r, h in headroom.items()
        ),
    )


def series(headroom_at: Any, hours: float, *, every: float = 2.0, key: str = "tpl/pods") -> MemoryTrend:
    """The trend after passes every `every` seconds for `hours`, rank 0 steady at 70 GiB and
    rank 3 at `headroom_at(hours since start)`."""
    trend: MemoryTrend | None = None
    t = T0
    while t <= T0 + hours * HOUR:
        obs = observation(t, {0: 70 * GiB, 3: int(headroom_at((t - T0) / HOUR))})
        trend = track(trend, obs, key=key, now=t, restarted=False)
        t += every
    assert trend is not None
    return trend


def falling(rate_gib: float, start_gib: float = 20.0) -> Any:
    return lambda h: (start_gib - rate_gib * h) * GiB


def judged(trend: MemoryTrend, old: list[dict[str, Any]] | None = None) -> tuple[str, str, str]:
    return memory_creep_condition(trend, SPEC, old or [])


# --- the series ---------------------------------------------------------------------------------


def test_one_sample_per_five_minutes_six_hours_kept_the_tightest_rank() -> None:
    trend = series(lambda h: 10 * GiB, hours=8, every=7.0)
    times = [t for t, _ in trend.samples]
    assert all(b - a >= SAMPLE_EVERY_SECONDS for a, b in itertools.pairwise(times))
    assert len(trend.samples) <= MAX_SAMPLES == 37
    assert times[-1] - times[0] <= KEEP_SECONDS and times[-1] > T0 + 7.9 * HOUR
    assert {b for _, b in trend.samples} == {10 * GiB}  # rank 3, not rank 0
    assert trend.rank == 3 and trend.gpu_bytes == GPU
    # small enough for status: under 2 KiB as the API server stores it (compact JSON)
    assert len(json.dumps(trend.to_status(LINE), separators=(",", ":"))) < 2048


def test_the_series_changes_once_per_sample_so_status_is_written_once_per_five_minutes() -> None:
    trend: MemoryTrend | None = None
    changes = 0
    for i in range(1800):  # an hour of passes every 2 s, headroom moving a little every pass
        t = T0 + 2.0 * i
        new = track(trend, observation(t, {0: 10 * GiB + i * MiB}), key="k", now=t, restarted=False)
        changes += new != trend
        trend = new
    assert changes == 1 + 12  # the series starts, then 12 samples (one the first pass after it)


def test_stale_or_missing_reports_take_no_sample_and_keep_the_series() -> None:
    trend = series(falling(2), hours=1.5)
    later = T0 + 2 * HOUR
    assert (
        track(trend, observation(later, {0: GiB}, stale=True), key="tpl/pods", now=later, restarted=False)
        == trend
    )
    assert track(trend, None, key="tpl/pods", now=later, restarted=False) == trend


def test_a_roll_a_replaced_pod_or_a_vllm_restart_starts_the_series_over() -> None:
    trend = series(falling(2), hours=2)
    now = T0 + 2.1 * HOUR
    obs = observation(now, {0: GiB})
    assert track(trend, obs, key="other-template/pods", now=now, restarted=False) == MemoryTrend(
        "other-template/pods"
    )
    reset = track(trend, obs, key="tpl/pods", now=now, restarted=True)
    assert reset == MemoryTrend("tpl/pods")  # and no sample in the pass that starts over
    # a termination listed again pass after pass leaves the empty series as it is (no write)
    assert track(reset, obs, key="tpl/pods", now=now + 400, restarted=True) == reset
    sampled = track(reset, obs, key="tpl/pods", now=now + 400, restarted=False)
    assert sampled is not None and sampled.samples == ((now + 400, GiB),)
    # a clock that went back makes the times meaningless
    assert track(trend, obs, key="tpl/pods", now=T0, restarted=False) == MemoryTrend("tpl/pods")
    assert track(trend, obs, key=None, now=now, restarted=False) is None


def test_the_key_is_the_template_and_the_pods_that_run_it() -> None:
    def p(name: str, template: str, *, deleting: bool = False) -> dict[str, Any]:
        doc = pod(name, {TEMPLATE_HASH_ANNOTATION: template}, ready=True)
        if deleting:
            doc["metadata"]["deletionTimestamp"] = "2027-01-15T08:00:00Z"
        return doc

    two = serving_key([p("a", "h1"), p("b", "h1"), p("old", "h0")], "h1")
    assert two == serving_key([p("b", "h1"), p("a", "h1"), p("gone", "h1", deleting=True)], "h1")
    assert two != serving_key([p("a", "h1"), p("c", "h1")], "h1")  # b was replaced
    assert two != serving_key([p("a", "h2"), p("b", "h2")], "h2")  # a roll
    assert serving_key([p("a", "h1")], None) is None


def test_status_round_trip_and_hand_edited_samples() -> None:
    trend = series(falling(2), hours=2)
    doc = trend.to_status(LINE)
    assert MemoryTrend.from_status(doc) == trend
    assert doc["bytesPerHour"] == -2 * GiB
    bad = {**doc, "samples": [[1, 2], "x", [3], [2, -5], [5, True], [4, 7], [3, 9]], "rank": -1}
    assert MemoryTrend.from_status(bad) == MemoryTrend(trend.key, ((1.0, 2), (4.0, 7)), None, GPU)
    assert MemoryTrend.from_status({"samples": []}) is None
    assert ServiceState.from_status({"memoryTrend": doc}).memory_trend == trend


# --- the fit and the verdict ----------------------------------------------------------------------


def test_a_steady_series_with_noise_is_no_creep() -> None:
    rng = random.Random(7)
    trend = series(lambda h: 12 * GiB + rng.uniform(-1, 1) * GiB, hours=6)
    f = fit(trend)
    assert f is not None and abs(f.bytes_per_hour) < 0.01 * GPU
    assert not creeping(f, LINE, was=False)
    status, reason, message = judged(trend)
    assert (status, reason) == ("False", "HeadroomSteady")
    assert message.startswith("rank 3's free GPU memory is ")


def test_a_slow_fall_over_hours_is_creep_with_its_slope_and_projection() -> None:
    trend = series(falling(2.0), hours=3)  # 2 GiB/h on an 80 GiB GPU: 2.5 % an hour
    f = fit(trend)
    assert f is not None
    assert abs(f.bytes_per_hour + 2 * GiB) < MiB
    last = (trend.samples[-1][0] - T0) / HOUR  # the first pass starts the series, samples follow
    assert abs(f.fitted_bytes - (20 - 2 * last) * GiB) < MiB
    hours = f.hours_to(LINE)
    assert hours is not None and abs(hours - ((20 - 2 * last) * GiB - LINE) / (2 * GiB)) < 0.01
    status, reason, message = judged(trend)
    assert (status, reason) == ("True", "HeadroomFalling")
    assert "rank 3's free GPU memory is falling 2Gi/h (least squares over 36 samples in 2h55m)" in message
    assert (
        f"reaches the low-headroom line (256Mi, spec.memory.minHeadroomBytes) in about {hours:.1f} h"
        in message
    )
    assert f"{hours:.1f}" == "7.0"
    assert "restarts nothing" in message


def test_not_judged_before_an_hour_of_samples() -> None:
    trend = series(falling(20.0), hours=0.9)  # steep, but 50 minutes say nothing yet
    assert fit(trend) is None
    status, reason, message = judged(trend)
    assert (status, reason) == ("False", "CollectingSamples")
    assert (
        message
        == "11 sample(s) of the tightest rank's headroom over 50 min; the trend is judged after an hour"
    )
    assert judged(MemoryTrend("k"))[:2] == ("False", "NotServing")
    assert memory_creep_condition(None, SPEC, [])[:2] == ("False", "NotServing")


def test_too_slow_or_too_far_from_the_line_is_no_creep() -> None:
    slow = judged(series(falling(1.0), hours=3))  # 1.25 % of the GPU an hour
    assert slow[:2] == ("False", "HeadroomSteady")
    assert slow[2].endswith("not falling faster than 2% of the GPU (1.6Gi) an hour")
    far = judged(series(falling(2.0, start_gib=60), hours=3))  # 54 GiB left: 27 h away
    assert far[:2] == ("False", "HeadroomSteady")
    assert far[2].endswith("is 27 h away, beyond 12 h"), far
    rising = judged(series(lambda h: (10 + h) * GiB, hours=2))
    assert "is rising 1Gi/h" in rising[2] and rising[2].endswith(": not falling")


def test_one_step_down_is_not_creep_a_staircase_is() -> None:
    # NCCL's buffers on the first traffic, ten minutes in: 5 GiB at once, then flat. A line
    # through it falls 5 GiB/h over the first hour; each half of the series alone does not.
    step = series(lambda h: (12 if h < 1 / 6 else 7) * GiB, hours=1.1)
    f = fit(step)
    assert f is not None and f.bytes_per_hour < -0.02 * GPU and f.a_step
    status, reason, message = judged(step)
    assert (status, reason) == ("False", "HeadroomSteady")
    assert message.endswith("one step down (one half of the samples holds the fall), not a steady fall")
    # the allocator growing in steps of 1 GiB every 20 minutes is creep
    stairs = series(lambda h: (16 - int(h * 3)) * GiB, hours=2)
    g = fit(stairs)
    assert g is not None and not g.a_step
    assert judged(stairs)[:2] == ("True", "HeadroomFalling")


def test_already_at_the_line_says_so() -> None:
    status, reason, message = judged(series(falling(2.0, start_gib=4), hours=2))
    assert (status, reason) == ("True", "HeadroomFalling")
    assert "has already reached the low-headroom line" in message


def test_noise_around_the_threshold_does_not_flap_the_condition() -> None:
    # a fall right at the threshold with noise: the bare verdict flips back and forth, the
    # condition (which remembers what it said) turns True once and stays
    rng = random.Random(3)
    noise = [rng.uniform(-1.5, 1.5) * GiB for _ in range(200)]
    trend: MemoryTrend | None = None
    conds: list[dict[str, Any]] = []
    bare, said = [], []
    for i in range(72):  # six hours of samples
        t = T0 + i * SAMPLE_EVERY_SECONDS
        headroom = 20 * GiB - 0.02 * GPU * (i * SAMPLE_EVERY_SECONDS / HOUR) + noise[i]
        trend = track(trend, observation(t, {0: int(headroom)}), key="k", now=t, restarted=False)
        f = fit(trend)
        if f is None:
            continue
        bare.append(creeping(f, LINE, was=False))
        status, reason, message = memory_creep_condition(trend, SPEC, conds)
        conds = set_condition(conds, Condition.MEMORY_CREEP, status, reason, message, str(t), 1)
        said.append(status == "True")
    assert flips(bare) >= 3, bare  # the noise is real
    assert flips(said) == 1 and said[-1], said


def flips(verdicts: list[bool]) -> int:
    return sum(a != b for a, b in itertools.pairwise(verdicts))


def test_creep_is_not_degraded_and_is_said_once() -> None:
    status, reason, message = judged(series(falling(2.0), hours=3))
    conds = set_condition([], Condition.READY, "True", "ReplicasReady", "", "t", 1)
    with_creep = set_condition(conds, Condition.MEMORY_CREEP, status, reason, message, "t", 1)
    assert phase_for(with_creep).value == "Running"
    event = creep_event(conds, with_creep)
    assert event is not None and (event.type, event.reason, event.message) == (
        "Warning",
        "MemoryCreep",
        message,
    )
    assert creep_event(with_creep, with_creep) is None


# --- the metrics ----------------------------------------------------------------------------------


def samples(name: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name == name and s.labels.get("namespace") == "creep":
                out[s.labels["llmservice"]] = s.value
    return out


def test_the_gauges_are_read_from_status_memory_trend() -> None:
    trend = series(falling(2.0), hours=3)
    judging: dict[str, Any] = {"phase": "Running", "memoryTrend": trend.to_status(LINE)}
    flat = {"phase": "Running", "memoryTrend": series(lambda h: 9 * GiB, hours=2).to_status(LINE)}
    young = {"phase": "Running", "memoryTrend": series(falling(2.0), hours=0.5).to_status(LINE)}
    try:
        for name, status in (("a", judging), ("b", flat), ("c", young)):
            SERVICE_GAUGES.set("creep", name, figures(status, SPEC))
        assert samples("rankguard_llmservice_headroom_trend_bytes_per_hour") == {"a": -2 * GiB, "b": 0.0}
        assert samples("rankguard_llmservice_headroom_exhaustion_hours") == {"a": 7.0}
        assert judging["memoryTrend"]["hoursToLine"] == 7.0
    finally:
        for name in "abc":
            forget_service("creep", name)


# --- through the real step ----------------------------------------------------------------------


def test_the_step_says_creep_never_rolls_for_it_and_writes_once_per_sample() -> None:
    c: Cluster = running()
    c.spec["memory"]["reclaim"] = False  # ample headroom would otherwise grow the budget
    name = c.pods[0]["metadata"]["name"]
    applied = len(c.deployments_applied)
    start, writes, events = c.clock, 0, []
    steady_writes = None
    while c.clock < start + 4 * HOUR:
        hours = (c.clock - start) / HOUR
        # the first hour steady (the status is written for the samples only), then 3 GiB/h
        free = int(30 * GiB - 3 * GiB * max(0.0, hours - 1))
        step = c.run(reports=((name, report((free, free + GiB), c.clock), c.clock),))
        c.clock += 8.0
        writes += sum(isinstance(e, WriteStatus) for e in step.effects)
        events += [e.reason for e in step.effects if isinstance(e, PostEvent)]
        assert not any(isinstance(e, ApplyDeployment) for e in step.effects)
        if steady_writes is None and c.clock >= start + HOUR:
            steady_writes = writes
    assert steady_writes is not None and steady_writes <= 12 + 3  # a sample each 5 minutes
    creep = condition(c.status["conditions"], Condition.MEMORY_CREEP)
    assert creep is not None and (creep["status"], creep["reason"]) == ("True", "HeadroomFalling")
    assert "rank 0's free GPU memory is falling" in creep["message"]
    assert events.count("MemoryCreep") == 1
    assert len(c.deployments_applied) == applied and not c.status.get("remediations")
    assert c.status["phase"] == "Running"
    trend = c.status["memoryTrend"]
    assert trend["rank"] == 0 and trend["bytesPerHour"] < -GiB

    # a vLLM restart starts the series over: the condition goes back to collecting
    p = c.pods[0]
    c.pods = [
        pod(name, p["metadata"]["annotations"], ready=True, terminated={"exitCode": 0, "reason": "Completed"})
    ]
    c.run(reports=((name, report((GiB, 2 * GiB), c.clock), c.clock),))
    assert c.status["memoryTrend"]["samples"] == []
    creep = condition(c.status["conditions"], Condition.MEMORY_CREEP)
    assert creep is not None and (creep["status"], creep["reason"]) == ("False", "NotServing")
