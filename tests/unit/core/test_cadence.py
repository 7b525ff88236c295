"""When a service's loop passes again without a wake-up (core/cadence, edge/executor.next_pass_in)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from rankguard_operator.core.cadence import resync_in, resync_phase
from rankguard_operator.core.step import Settings
from rankguard_operator.edge.executor import ServiceExecutor

FAST, SLOW = 2.0, 30.0


def executor(busy: bool, due_in: float | None = None, name: str = "svc") -> ServiceExecutor:
    ex = ServiceExecutor(name, "ns", Settings(agent_image="a:1", stale_after=30.0))
    ex.busy, ex.due_in = busy, due_in
    return ex


@pytest.mark.parametrize("now", [0.0, 12.3, 1e6 + 0.7])
def test_a_busy_service_passes_at_the_fast_cadence(now: float) -> None:
    assert executor(busy=True).next_pass_in(FAST, SLOW, now) == FAST


def test_a_steady_service_resyncs_at_its_own_moment_exactly_an_interval_apart() -> None:
    steady = executor(busy=False)
    moment = steady.phase * SLOW
    now = 1000.0
    passes = []
    for _ in range(6):
        now += steady.next_pass_in(FAST, SLOW, now) + 0.004  # a pass starts a little late
        passes.append(now)
    assert all((t - moment) % SLOW == pytest.approx(0.004, abs=1e-6) for t in passes)
    gaps = [b - a for a, b in itertools.pairwise(passes)]
    assert gaps == pytest.approx([SLOW] * 5)  # two a minute at 30 s, never more


@pytest.mark.parametrize("now", [0.0, 3.0, 14.9, 15.0, 29.99, 777.7])
@pytest.mark.parametrize("phase", [0.0, 0.25, 0.5, 0.999])
def test_a_resync_after_a_woken_pass_is_between_half_and_one_and_a_half_intervals(
    now: float, phase: float
) -> None:
    wait = resync_in(now, SLOW, phase)
    assert SLOW / 2 <= wait < 1.5 * SLOW
    off = (now + wait - phase * SLOW) % SLOW  # how far it lands from its own moment
    assert min(off, SLOW - off) < 1e-6


def test_a_verdict_that_falls_due_comes_before_the_resync() -> None:
    assert executor(busy=False, due_in=4.0).next_pass_in(FAST, SLOW, 0.0) == 4.0
    assert executor(busy=False, due_in=-1.0).next_pass_in(FAST, SLOW, 0.0) == 0.0
    assert executor(busy=True, due_in=40.0).next_pass_in(FAST, SLOW, 0.0) == FAST


def test_a_service_keeps_its_moment_across_executors_and_replicas() -> None:
    assert resync_phase("ns", "svc") == executor(busy=False).phase == resync_phase("ns", "svc")
    assert resync_phase("ns", "svc") != resync_phase("ns2", "svc")


def test_services_that_passed_together_resync_spread_over_the_interval() -> None:
    # a thousand services whose last pass started in the same second (created together, or an
    # operator restart): with one fixed interval they would pass in one second for as long as
    # they run; at their own moments no second of the interval holds more than a few percent
    services = [executor(busy=False, name=f"svc-{i}") for i in range(1000)]
    resyncs = [100.0 + s.next_pass_in(FAST, SLOW, 100.0) for s in services]
    per_second = Counter(int(t % SLOW) for t in resyncs)
    assert len(per_second) == int(SLOW) and max(per_second.values()) < 60  # even: ~33 each
