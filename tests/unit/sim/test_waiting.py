"""The sandbox's two waits: for a condition (wait_for) and for time itself (let_time_pass)."""

from __future__ import annotations

import time

import pytest

from rankguard_sim.waiting import let_time_pass, wait_for


def test_wait_for_returns_the_first_truthy_value_and_names_what_timed_out() -> None:
    seen = iter([None, 0, {"ready": True}])
    assert wait_for("the third answer", lambda: next(seen), timeout=10, every=0.01) == {"ready": True}
    with pytest.raises(AssertionError, match=r"(?s)waiting for never.*last seen: False\n\[\n 1,\n 2\n\]"):
        wait_for("never", lambda: False, timeout=0.05, every=0.01, dump=lambda: [1, 2])


def test_let_time_pass_ends_early_when_told_to_stop() -> None:
    calls = iter([False, False, True])
    started = time.monotonic()
    assert let_time_pass(60, stop=lambda: next(calls), every=0.01) is True
    assert time.monotonic() - started < 60


def test_let_time_pass_lets_all_of_it_pass_otherwise() -> None:
    started = time.monotonic()
    assert let_time_pass(0.1, stop=lambda: False, every=0.01) is False
    assert let_time_pass(0.05) is False
    assert time.monotonic() - started >= 0.15
