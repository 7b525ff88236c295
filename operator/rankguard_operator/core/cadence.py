"""When a steady service's loop passes again without a wake-up: its own moment in each resync
interval (edge/executor.next_pass_in picks between this and the busy cadence).

Why not simply every `slow` seconds after the last pass: services created together, or all of
them after an operator restart, would then resync in the same second for as long as they run,
a thousand passes in one burst every interval. Each keeps its own moment instead.

Pure: no I/O; times come in as arguments.
"""

from __future__ import annotations

import zlib


def resync_phase(namespace: str, name: str) -> float:
    """This service's moment in each resync interval, as a fraction of it: the same in every
    pass and every operator replica, and spread evenly over the services."""
    return zlib.crc32(f"{namespace}/{name}".encode()) / 2**32


def resync_in(now: float, slow: float, phase: float) -> float:
    """Seconds from `now` to the service's next resync: the next moment `phase * slow` past a
    multiple of `slow` that is at least half an interval away, so between `slow / 2` and
    `1.5 * slow`, and exactly `slow` apart while nothing else makes it pass."""
    first = now + slow / 2
    return slow / 2 + (phase * slow - first) % slow
