"""Which status writes can wait: a patch that only lets the ranks' memory figures drift.

Free memory moves a little between any two samples, so an exact status would be rewritten on
nearly every pass: at 1,000 services, hundreds of writes a second for figures nobody acts on
(issue 31). A patch is held back (not written) when all it changes is the ranks' figures and the
printer columns derived from them, each rank's by at most `NEWS_FRACTION` of its GPU (the same
resolution as the agent's long-poll, rankguard_agent.wire.change), none across a policy line
(the low-headroom and reclaim lines), and the status was written less than `HOLD_SECONDS` ago.
Anything else (a condition, the phase, the budget, a remediation, a rank gone stale, a figure
that moved more) is written at once, with the held figures brought up to date in the same write.

So `kubectl get llmservice` is truthful to 1 % of the GPU, and never older than HOLD_SECONDS.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rankguard_agent.wire.change import NEWS_FRACTION
from rankguard_operator.core.status.groups import DRIFTING

# Figures that only drifted are written at least this often: the trend's sampling period
# (core/observe/memory_trend writes a sample every 5 minutes anyway).
HOLD_SECONDS = 300.0

# The status fields that follow the ranks' figures (core/status/build: rank_rows, rank_lines,
# summary_fields). Which of two ranks within a percent of each other is the bottleneck is itself
# drift at this resolution.
_FIGURE_FIELDS = frozenset(
    {
        "ranks",
        "perRank",
        "rank0Headroom",
        "minHeadroom",
        "bottleneck",
        "bottleneckRank",
        "bottleneckPod",
        "bottleneckStage",
        "groupFigures",  # core/status/groups: each group's tightest rank follows the ranks
        "perGroup",
    }
)
_ROW_FIGURES = ("freeBytes", "minFreeBytes", "headroomBytes")
_ROW_TEXT = ("headroom",)  # follows headroomBytes


def _row_drifted(a: Mapping[str, Any], b: Mapping[str, Any], lines: Sequence[int]) -> bool:
    """True when row `b` differs from `a` only by figures within the resolution."""
    skip = (*_ROW_FIGURES, *_ROW_TEXT)
    if {k: v for k, v in a.items() if k not in skip} != {k: v for k, v in b.items() if k not in skip}:
        return False
    total = a.get("totalBytes")
    if not isinstance(total, int) or total <= 0:
        return False
    for key in _ROW_FIGURES:
        x, y = a.get(key), b.get(key)
        if not isinstance(x, int) or not isinstance(y, int):
            return False
        if abs(x - y) > NEWS_FRACTION * total:
            return False
    x, y = a["minFreeBytes"], b["minFreeBytes"]
    return all((x < line) == (y < line) for line in lines)


def _groups_drifted(old: Any, new: Any) -> bool:
    """True when the groups' rows differ only in the figures that follow the ranks (a pod that
    turned ready, or a group that lost or gained its reports, is news)."""
    if not isinstance(old, list) or not isinstance(new, list) or len(old) != len(new):
        return False
    for a, b in zip(old, new, strict=True):
        if not isinstance(a, Mapping) or not isinstance(b, Mapping):
            return False
        if {k: v for k, v in a.items() if k not in DRIFTING} != {
            k: v for k, v in b.items() if k not in DRIFTING
        }:
            return False
        if ("headroomBytes" in a) != ("headroomBytes" in b):
            return False
    return True


def only_drift(
    old_status: Mapping[str, Any] | None, patch: Mapping[str, Any], lines: Sequence[int] = ()
) -> bool:
    """True when `patch` (a status_patch of `old_status`) changes nothing but rank figures that
    drifted within the resolution and across none of `lines`."""
    if not patch or not set(patch) <= _FIGURE_FIELDS or "ranks" not in patch:
        return False
    old_rows = (old_status or {}).get("ranks")
    new_rows = patch["ranks"]
    if not isinstance(old_rows, list) or not isinstance(new_rows, list) or len(old_rows) != len(new_rows):
        return False
    if "groupFigures" in patch and not _groups_drifted(
        (old_status or {}).get("groupFigures"), patch["groupFigures"]
    ):
        return False
    return all(
        isinstance(a, Mapping) and isinstance(b, Mapping) and _row_drifted(a, b, lines)
        for a, b in zip(old_rows, new_rows, strict=True)
    )


def hold(
    old_status: Mapping[str, Any] | None,
    patch: Mapping[str, Any],
    since_write: float | None,
    lines: Sequence[int] = (),
) -> bool:
    """Whether to leave this status write for later: only drift, and the status was written less
    than HOLD_SECONDS ago (`since_write`; None when this process has not written it yet, when
    nothing is held: after a restart the first pass writes what it sees)."""
    return since_write is not None and since_write < HOLD_SECONDS and only_drift(old_status, patch, lines)
