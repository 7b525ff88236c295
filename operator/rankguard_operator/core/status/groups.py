"""A multi-node service's groups as a person reads them: per group, its tightest rank's headroom
and how many of its pods are ready (`status.groupFigures` for tools, `status.perGroup` one line
per group for `kubectl describe`).

Why per group: `status.ranks` keeps each rank's worst replica, which says which rank is short
but not which group is; and a group of 16 or 32 GPUs listed rank by rank is hundreds of lines in
`kubectl describe`. So `status.perRank` (the lines) is bounded to the tightest PER_RANK_LINES
ranks and a pointer to `status.ranks`, which keeps every rank for tools and metrics (bounded by
the CRD: at most 64 GPUs per replica).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.observe.groups import Groups
from rankguard_operator.core.observe.headroom import Observation, ReportInput
from rankguard_operator.core.observe.pods import get_path, pod_ready
from rankguard_operator.core.units import format_bytes

# status.perRank's lines: the tightest ranks beyond this are only in status.ranks
PER_RANK_LINES = 8
# the figures that follow the ranks' samples (core/status/hold: drift, not news)
DRIFTING = ("headroomBytes", "headroom", "tightestRank", "tightestPod")


@dataclass(frozen=True)
class GroupFigure:
    """One group: its pods (ready of wanted) and its tightest fresh rank, if any reported."""

    index: int
    pods: int
    pods_ready: int
    tightest_rank: int | None = None
    tightest_pod: str | None = None
    headroom_bytes: int | None = None

    def to_status(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"group": self.index, "pods": self.pods, "podsReady": self.pods_ready}
        if self.headroom_bytes is not None:
            doc.update(
                tightestRank=self.tightest_rank,
                tightestPod=(self.tightest_pod or "")[:253],
                headroomBytes=self.headroom_bytes,
                headroom=format_bytes(self.headroom_bytes),
            )
        return doc

    def line(self, tp: int) -> str:
        """ "group 1: 2/2 pods ready, tightest rank 13 (stage 1) on svc-g1-w-1: headroom 3Gi"."""
        text = f"group {self.index}: {self.pods_ready}/{self.pods} pods ready"
        if self.headroom_bytes is None or self.tightest_rank is None:
            return text + ", no fresh report"
        stage = self.tightest_rank // max(tp, 1)
        pod = (self.tightest_pod or "")[:253]
        return (
            f"{text}, tightest rank {self.tightest_rank} (stage {stage}) on {pod}: "
            f"headroom {format_bytes(self.headroom_bytes)}"
        )


def _name(obj: Mapping[str, Any]) -> str:
    return str(get_path(obj, "metadata", "name") or "")


def group_figures(
    groups: Groups | None, reports: Sequence[ReportInput], observation: Observation | None, replicas: int
) -> list[GroupFigure]:
    """Each wanted group (0 … replicas−1, present or not): its live pods of its own template that
    are ready, and the least headroom over its pods' fresh reports (a rank sample with an error
    is left out, as the policy leaves it out)."""
    if groups is None:
        return []
    fresh = set(observation.fresh_pods) if observation is not None else set()
    by_pod = {pod: report for pod, report, _at in reports if pod in fresh}
    out = []
    for index in range(replicas):
        g = groups.get(index)
        size = g.size if g is not None else 0
        live = [] if g is None else g.live_pods(g.template_hash)
        ready = sum(1 for p in live if pod_ready(p))
        samples = [
            (s.min_free_bytes, s.rank, _name(p))
            for p in (g.pods if g is not None else ())
            if _name(p) in by_pod
            for s in by_pod[_name(p)].ranks
            if s.error is None
        ]
        if not samples:
            out.append(GroupFigure(index, size, ready))
            continue
        headroom, rank, pod = min(samples)
        out.append(GroupFigure(index, size, ready, rank, pod, headroom))
    return out


def bounded_rank_lines(lines: Sequence[tuple[int, str]], limit: int = PER_RANK_LINES) -> list[str]:
    """`status.perRank` from (headroom bytes, line) per rank in rank order: every line while
    there are at most `limit`, else the `limit` tightest (in rank order) and one line saying
    where the rest are."""
    if len(lines) <= limit:
        return [line for _, line in lines]
    keep = sorted(sorted(range(len(lines)), key=lambda i: (lines[i][0], i))[:limit])
    more = len(lines) - limit
    return [
        *(lines[i][1] for i in keep),
        f"... and {more} more ranks with more headroom (every rank: status.ranks, or "
        "kubectl get llmservice NAME -o jsonpath='{.status.ranks}')",
    ]
