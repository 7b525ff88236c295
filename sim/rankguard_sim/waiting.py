"""Polling until something is true: the one wait loop the sandbox and its tests share."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any


def wait_for(
    what: str,
    probe: Callable[[], Any],
    timeout: float = 60,
    every: float = 0.2,
    dump: Callable[[], Any] | None = None,
) -> Any:
    """Call `probe` until it returns something truthy, and return that. On timeout, raise an
    AssertionError naming `what`, the last value seen and, if given, what `dump()` shows."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    context = f"\n{json.dumps(dump(), indent=1, default=str)[:6000]}" if dump else ""
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}; last seen: {last!r:.2000}{context}"
    )


def let_time_pass(seconds: float, stop: Callable[[], Any] | None = None, every: float = 0.2) -> bool:
    """Let `seconds` pass where time passing is itself the point (an outage's length, the moment
    a fault drill strikes), checking `stop` meanwhile. Return True as soon as `stop()` is truthy,
    False once the time is up."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if stop is not None and stop():
            return True
        time.sleep(min(every, left))
    return bool(stop is not None and stop())
