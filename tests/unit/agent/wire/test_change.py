"""When a report is news (rankguard_agent.wire.change): the rule the agent's long-poll and the
operator's feed share, and the poll's query and token checks."""

from __future__ import annotations

import dataclasses

import pytest

from rankguard_agent.wire.change import MAX_LINES, clean_token, news, parse_lines
from rankguard_agent.wire.report import KVLine, RankSample, Report

GIB = 1 << 30
TOTAL = 80 * GIB


def report(*min_free: int, free_extra: int = GIB, ts: float = 100.0, **kw: object) -> Report:
    ranks = [
        RankSample(
            rank=r,
            uuid=f"GPU-{r}",
            total_bytes=TOTAL,
            used_bytes=TOTAL - (m + free_extra),
            free_bytes=m + free_extra,
            min_free_bytes=m,
            window_seconds=60.0,
        )
        for r, m in enumerate(min_free)
    ]
    return Report(version=1, agent_version="0.1.0", timestamp=ts, ranks=ranks, **kw)  # type: ignore[arg-type]


def test_the_first_report_is_news() -> None:
    assert news(None, report(10 * GIB)) == "first report"


def test_drift_within_a_percent_of_the_gpu_and_a_new_timestamp_are_not_news() -> None:
    quantum = TOTAL // 100
    before = report(10 * GIB, 12 * GIB)
    after = report(10 * GIB - quantum, 12 * GIB + quantum // 2, ts=160.0)
    assert news(before, after) is None


def test_a_move_beyond_a_percent_is_news_and_names_the_rank_and_figure() -> None:
    before = report(10 * GIB, 12 * GIB)
    after = report(10 * GIB, 12 * GIB - TOTAL // 100 - 1)
    assert news(before, after) == "rank 1: free_bytes moved by more than 1% of its GPU"


def test_a_tiny_move_across_a_line_is_news_and_the_same_move_without_lines_is_not() -> None:
    line = 8 * GIB
    before, after = report(line), report(line - 1)
    assert news(before, after) is None
    assert news(before, after, lines=(line,)) == f"rank 0: minimum free memory crossed {line} bytes"
    assert news(after, before, lines=(line,)) is not None  # back above it too


@pytest.mark.parametrize(
    "change",
    [
        {"kv_lines": [KVLine("kv_cache_tokens", "GPU KV cache size: 1 tokens", 1.0, 5.0)]},
        {"engine_version": "0.33.0"},
        {"sampler_ok": False},
        {"unparsed_lines": {"worker_prefix": 1}},
    ],
)
def test_anything_beyond_the_memory_figures_is_news(change: dict[str, object]) -> None:
    before = report(10 * GIB)
    assert news(before, dataclasses.replace(before, timestamp=200.0, **change)) is not None  # type: ignore[arg-type]


def test_a_rank_error_or_a_rank_gone_is_news() -> None:
    before = report(10 * GIB, 10 * GIB)
    lost = dataclasses.replace(
        before, ranks=[before.ranks[0], dataclasses.replace(before.ranks[1], error="GpuIsLost")]
    )
    assert news(before, lost) == "rank 1 changed"
    assert news(before, report(10 * GIB)) == "its ranks changed"


def test_poll_lines_are_parsed_and_bounded() -> None:
    assert parse_lines(None) == () and parse_lines("") == ()
    assert parse_lines("8589934592,17179869184") == (8 * GIB, 16 * GIB)
    for bad in ("x", "-1", "1,,2", ",".join(["1"] * (MAX_LINES + 1)), str(1 << 63)):
        with pytest.raises(ValueError):
            parse_lines(bad)


def test_a_token_is_kept_only_when_short_and_printable() -> None:
    assert clean_token("a1b2c3d4-17") == "a1b2c3d4-17"
    assert clean_token(None) is None and clean_token("") is None
    assert clean_token("x" * 65) is None and clean_token("a b") is None and clean_token("é") is None
