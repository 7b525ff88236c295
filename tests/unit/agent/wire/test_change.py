"""When a report is news (rankguard_agent.wire.change): the rule the agent's long-poll and the
operator's feed share, and the poll's query and token checks."""

from __future__ import annotations

import dataclasses

import pytest

from rankguard_agent.wire.change import MAX_LINES, clean_token, news, parse_lines
from rankguard_agent.wire.report import KVLine, RankSample, Report
from rankguard_agent.wire.report_memory import OtherProcess, WarmupMemory

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
        {"vmm": False},
        {"imex_channel": True},
        {"extensible_disabled": "the driver does not support virtual memory management"},
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


def others(r: Report, **kw: object) -> Report:
    """`r` with its rank 0's others fields set (and a later timestamp)."""
    return dataclasses.replace(r, timestamp=r.timestamp + 60, ranks=[dataclasses.replace(r.ranks[0], **kw)])  # type: ignore[arg-type]


def test_others_on_the_gpu_are_figures_news_only_beyond_a_percent() -> None:
    quantum = TOTAL // 100
    base = others(report(10 * GIB), others_bytes=5 * GIB, others_peak_bytes=6 * GIB)
    assert news(base, others(base, others_bytes=5 * GIB + quantum)) is None
    assert news(base, others(base, others_bytes=5 * GIB + quantum + 1)) == (
        "rank 0: others_bytes changed by more than 1% of its GPU"
    )
    assert news(base, others(base, others_peak_bytes=7 * GIB)) is not None
    assert news(base, others(base, others_bytes=None)) is not None  # became unknown
    assert news(others(base, others_bytes=None), base) is not None  # became known


def test_the_processes_named_are_news_when_they_change_not_when_they_swap_places() -> None:
    a, b = OtherProcess(41, "python3", 3 * GIB), OtherProcess(42, "ollama", 3 * GIB + 1)
    base = others(report(10 * GIB), others_bytes=6 * GIB + 1, others=[b, a])
    assert news(base, others(base, others=[a, b])) is None
    assert news(base, others(base, others=[b])) == "rank 0: other processes on its GPU changed"
    assert news(base, others(base, others=[b, OtherProcess(41, "python3", 5 * GIB)])) is not None


def test_a_ranks_warmup_line_is_news() -> None:
    warmup = WarmupMemory(1, 2, 3, 3, 1, 4, 5, 6, 7)
    before = report(10 * GIB)
    assert news(before, others(before, warmup=warmup)) == "rank 0 changed"


def test_the_load_figures_are_news_once_when_they_change() -> None:
    """Set once per engine start: news then (however small), and not again while they stay."""
    before = report(10 * GIB)
    marked = others(before, free_at_load_bytes=70 * GIB, others_at_load_bytes=0)
    assert news(before, marked) == "rank 0 changed"
    assert news(marked, dataclasses.replace(marked, timestamp=marked.timestamp + 60)) is None
    assert news(marked, others(marked, free_at_load_bytes=70 * GIB + 1)) == "rank 0 changed"
    assert news(marked, others(marked, others_at_load_bytes=None)) == "rank 0 changed"
