"""The /report contract's engine fields: the agent writes them, the operator's `parse_report`
reads them back, and a malformed engine field is dropped (and said so) without losing the report."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rankguard_agent.wire.report import EngineMemory, RankSample, Report, ReportError, parse_report

GIB = 1 << 30
MEMORY = EngineMemory(
    consumed_bytes=16 * GIB,
    peak_activation_bytes=3 * GIB,
    cuda_graph_bytes=GIB // 2,
    kv_in_use_bytes=40 * GIB,
    free_at_start_bytes=78 * GIB,
    total_bytes=80 * GIB,
    requested_bytes=72 * GIB,
    kv_to_requested_bytes=-1_800_000_000,
    kv_to_gpu_bytes=60_900_111_222,
)


def rank(i: int, memory: EngineMemory | None = None) -> RankSample:
    return RankSample(i, f"GPU-{i}", 80 * GIB, 40 * GIB, 40 * GIB, 39 * GIB, 60.0, engine_memory=memory)


def report(**kw: Any) -> Report:
    base: dict[str, Any] = {
        "version": 1,
        "agent_version": "t",
        "timestamp": 1.0,
        "ranks": [rank(0, MEMORY), rank(1)],
    }
    base.update(kw)
    return Report(**base)


def doc(r: Report) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(r.to_json())
    return out


def test_engine_fields_round_trip() -> None:
    sent = report(engine_version="0.33.0")
    d = doc(sent)
    assert d["engine_version"] == "0.33.0"
    assert d["ranks"][0]["engine_memory"]["kv_to_gpu_bytes"] == 60_900_111_222
    assert d["ranks"][1]["engine_memory"] is None
    assert "dropped_fields" not in d  # the operator's own note, never part of the contract
    got = parse_report(sent.to_json())
    assert got == sent
    assert got.ranks[0].engine_memory == MEMORY and got.engine_version == "0.33.0"


def test_a_partial_engine_memory_is_kept() -> None:
    # Only the CUDA graph pool line (vLLM prints no report when --kv-cache-memory-bytes is set).
    sent = report(ranks=[rank(0, EngineMemory(cuda_graph_bytes=GIB))])
    got = parse_report(sent.to_json())
    assert got.ranks[0].engine_memory == EngineMemory(cuda_graph_bytes=GIB)


def test_an_older_agent_without_engine_fields_still_parses() -> None:
    d = doc(report())
    del d["engine_version"]
    for r in d["ranks"]:
        del r["engine_memory"]
    got = parse_report(json.dumps(d).encode())
    assert got.engine_version is None and all(r.engine_memory is None for r in got.ranks)
    assert got.dropped_fields == []


@pytest.mark.parametrize(
    "bad",
    [
        "16 GiB",
        [1, 2],
        {"consumed_bytes": "16"},
        {"consumed_bytes": True},
        {"consumed_bytes": 1.5},
        {"consumed_bytes": -1},
        {"kv_to_gpu_bytes": 1 << 60},
        {"free_at_start_bytes": 81 * GIB, "total_bytes": 80 * GIB},
    ],
)
def test_a_malformed_engine_memory_is_dropped_for_that_rank_only(bad: Any) -> None:
    d = doc(report())
    d["ranks"][1]["engine_memory"] = bad
    got = parse_report(json.dumps(d).encode())
    assert got.ranks[0].engine_memory == MEMORY
    assert got.ranks[1].engine_memory is None
    assert len(got.dropped_fields) == 1 and got.dropped_fields[0].startswith("report.ranks[1].engine_memory")


@pytest.mark.parametrize("bad", [3, ["0.33.0"], "x" * 200])
def test_a_malformed_engine_version_is_dropped(bad: Any) -> None:
    d = doc(report(engine_version="0.33.0"))
    d["engine_version"] = bad
    got = parse_report(json.dumps(d).encode())
    assert got.engine_version is None
    assert [f.split(":")[0] for f in got.dropped_fields] == ["report.engine_version"]


def test_a_sender_cannot_write_the_dropped_notes() -> None:
    d = doc(report())
    d["dropped_fields"] = ["made up"]
    assert parse_report(json.dumps(d).encode()).dropped_fields == []


def test_the_rest_of_a_report_is_still_checked() -> None:
    d = doc(report())
    d["ranks"][0]["free_bytes"] = "x"
    with pytest.raises(ReportError):
        parse_report(json.dumps(d).encode())


def test_unparsed_line_counts_travel_and_a_bad_count_is_dropped_alone() -> None:
    from rankguard_agent.wire.report import REPORT_VERSION, RankSample, Report, parse_report

    sample = RankSample(0, "GPU-0", 100, 50, 50, 40, 10.0)
    good = Report(REPORT_VERSION, "a", 1.0, [sample], unparsed_lines={"worker_memory_report": 3})
    assert parse_report(good.to_json()).unparsed_lines == {"worker_memory_report": 3}
    import json

    doc = json.loads(good.to_json())
    doc["unparsed_lines"] = {"worker_memory_report": -1}
    bad = parse_report(json.dumps(doc).encode())
    assert bad.unparsed_lines == {} and bad.ranks == [sample]
    assert any("unparsed_lines" in d for d in bad.dropped_fields)
