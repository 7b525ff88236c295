"""When a report says something new: the one rule the agent's long-poll and the operator share.

A serving pod's free memory moves a little between any two readings (allocator churn, a batch
coming and going). Were every such move news, the agent would answer every long-poll at once and
the operator would pass and rewrite status every time (issue 31: 1,000 services, a core). So a
report is news against an earlier one only when

* anything but its timestamp and its ranks' memory figures differs (a KV line, the probe, the
  engine's version or memory account, the model, a rank's error, the sampler's health, a rank's
  free or others' memory at its weights' load, which change once per engine start, ...), or
* a rank's free, minimum free or used memory, or the memory of others on its GPU (now, at its
  peak, or held by one of the processes named), moved by more than `NEWS_FRACTION` of its GPU,
  or became known or unknown, or the processes named are others, or
* a rank's minimum free memory crossed one of `lines` (bytes: the policy's low-headroom and
  reclaim lines, which the operator sends with its poll), however small the move.

The operator compares with the report its last pass read (a slow drift adds up until it is
news); the agent with the report it last answered that poller with.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from rankguard_agent.wire.report import RankSample, Report

# 1 % of the GPU (0.8 GiB of an 80 GiB card): well above the churn of a steady server, well
# below the headroom the policy keeps (a rank's figure shown in status is this exact).
NEWS_FRACTION = 0.01
MAX_LINES = 8  # lines a poller may send: the policy has two; more is a malformed query

# The long-poll, `GET /report?wait=<seconds>&since=<token>&lines=<bytes>,<bytes>`: answered at
# once when the report is news against the one answered as `since` (or `since` is unknown),
# else when it becomes news, else after `wait` seconds (at most MAX_WAIT_SECONDS) with the report
# as it is. Every answer names itself in REPORT_TOKEN_HEADER; a plain GET /report is unchanged.
REPORT_TOKEN_HEADER = "X-Rankguard-Report-Token"
MAX_WAIT_SECONDS = 60.0
MAX_TOKEN = 64  # characters of a token kept; an agent's are far shorter


# What is compared field by field (no copies: a held poll looks at the report every second, and
# a bench serves a thousand agents from one process). The figures and the timestamp are not.
_FIGURES = ("free_bytes", "min_free_bytes", "used_bytes")
# Others' memory moves as theirs does (wire/report_memory.py): figures too, but optional ones.
_OPTIONAL_FIGURES = ("others_bytes", "others_peak_bytes")
_RANK_FIELDS = tuple(
    f.name for f in dataclasses.fields(RankSample) if f.name not in (*_FIGURES, *_OPTIONAL_FIGURES, "others")
)
_REPORT_FIELDS = tuple(f.name for f in dataclasses.fields(Report) if f.name not in ("timestamp", "ranks"))


def _rank_news(a: RankSample, b: RankSample, lines: Sequence[int]) -> str | None:
    if any(getattr(a, name) != getattr(b, name) for name in _RANK_FIELDS):
        return f"rank {b.rank} changed"
    quantum = NEWS_FRACTION * max(a.total_bytes, 1)
    for name in _FIGURES:
        if abs(getattr(a, name) - getattr(b, name)) > quantum:
            return f"rank {b.rank}: {name} moved by more than {NEWS_FRACTION:.0%} of its GPU"
    why = _others_news(a, b, quantum)
    if why is not None:
        return why
    for line in lines:
        if (a.min_free_bytes < line) != (b.min_free_bytes < line):
            return f"rank {b.rank}: minimum free memory crossed {line} bytes"
    return None


def _moved(a: int | None, b: int | None, quantum: float) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    return abs(a - b) > quantum


def _others_news(a: RankSample, b: RankSample, quantum: float) -> str | None:
    for name in _OPTIONAL_FIGURES:
        if _moved(getattr(a, name), getattr(b, name), quantum):
            return f"rank {b.rank}: {name} changed by more than {NEWS_FRACTION:.0%} of its GPU"
    # By pid, not by place: two neighbours of about one size may swap places from tick to tick.
    held = {(o.pid, o.name): o.bytes for o in a.others}
    now = {(o.pid, o.name): o.bytes for o in b.others}
    if held.keys() != now.keys():
        return f"rank {b.rank}: other processes on its GPU changed"
    if any(_moved(held[k], now[k], quantum) for k in now):
        return f"rank {b.rank}: another process's memory moved by more than {NEWS_FRACTION:.0%} of its GPU"
    return None


def news(before: Report | None, after: Report, lines: Sequence[int] = ()) -> str | None:
    """Why `after` is news against `before` (a short text), or None when it is not."""
    if before is None:
        return "first report"
    if any(getattr(before, name) != getattr(after, name) for name in _REPORT_FIELDS):
        return "the report changed beyond its memory figures"
    if len(before.ranks) != len(after.ranks):
        return "its ranks changed"
    for a, b in zip(before.ranks, after.ranks, strict=True):
        why = _rank_news(a, b, lines)
        if why is not None:
            return why
    return None


def parse_lines(text: str | None) -> tuple[int, ...]:
    """A poll's `lines=` (comma-separated non-negative byte counts); ValueError when malformed."""
    if not text:
        return ()
    parts = text.split(",")
    if len(parts) > MAX_LINES:
        raise ValueError(f"at most {MAX_LINES} lines")
    lines = tuple(int(p) for p in parts)
    if any(v < 0 or v > 1 << 62 for v in lines):
        raise ValueError("a line is a byte count from 0 to 2**62")
    return lines


def clean_token(value: str | None) -> str | None:
    """A token as the operator keeps it: printable ASCII, bounded; None for anything else (an
    older agent sends none, and is then scraped at the operator's interval instead)."""
    if not value or len(value) > MAX_TOKEN or not all("!" <= c <= "~" for c in value):
        return None
    return value
