"""The report's memory fields of issue 49 (wire/report_memory.py): others on the GPU, a rank's
"Memory after warmup", the driver's VMM and IMEX, the reason the extensible KV cache is off.
The agent writes them, `parse_report` reads them back; each malformed one is dropped alone and
named, and a report without them (an older agent's) parses as before."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import pytest

from rankguard_agent.wire.report import RankSample, Report, ReportError, parse_report
from rankguard_agent.wire.report_memory import MAX_OTHERS, OtherProcess, WarmupMemory

GIB = 1 << 30
WARMUP = WarmupMemory(
    free_bytes=12 * GIB,
    committed_bytes=2 * GIB,
    kept_bytes=3 * GIB,
    peak_bytes=3 * GIB,
    torch_growth_bytes=GIB,
    blocks=41_000,
    blocks_bytes=60 * GIB,
    requested_bytes=79 * GIB,
    torch_cap_bytes=14 * GIB,
)
# the rank fields of report_memory that are None when unknown ("others" is [] then)
RANK_FIELDS = (
    "others_bytes",
    "others_peak_bytes",
    "warmup",
    "free_at_load_bytes",
    "others_at_load_bytes",
)
NEIGHBOURS = [OtherProcess(4242, "python3", 6 * GIB), OtherProcess(77, "pid 77", GIB)]


def rank(i: int, **kw: Any) -> RankSample:
    return RankSample(i, f"GPU-{i}", 80 * GIB, 40 * GIB, 40 * GIB, 39 * GIB, 60.0, **kw)


def full() -> Report:
    return Report(
        version=1,
        agent_version="t",
        timestamp=1.0,
        ranks=[
            rank(
                0,
                others_bytes=8 * GIB,
                others_peak_bytes=9 * GIB,
                others=NEIGHBOURS,
                warmup=WARMUP,
                free_at_load_bytes=70 * GIB,
                others_at_load_bytes=8 * GIB,
            ),
            rank(1, others_bytes=0, others_peak_bytes=0),
        ],
        vmm=True,
        imex_channel=False,
        extensible_disabled="the driver does not support virtual memory management",
    )


def doc(r: Report) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(r.to_json())
    return out


def parse(d: dict[str, Any]) -> Report:
    return parse_report(json.dumps(d).encode())


def test_the_memory_fields_round_trip_under_the_contracts_names() -> None:
    sent = full()
    d = doc(sent)
    r0 = d["ranks"][0]
    assert (r0["others_bytes"], r0["others_peak_bytes"]) == (8 * GIB, 9 * GIB)
    assert r0["others"][0] == {"pid": 4242, "name": "python3", "bytes": 6 * GIB}
    assert r0["warmup"]["torch_cap_bytes"] == 14 * GIB and r0["warmup"]["blocks"] == 41_000
    assert (r0["free_at_load_bytes"], r0["others_at_load_bytes"]) == (70 * GIB, 8 * GIB)
    assert (d["ranks"][1]["free_at_load_bytes"], d["ranks"][1]["others_at_load_bytes"]) == (None, None)
    assert (d["vmm"], d["imex_channel"]) == (True, False)
    assert d["extensible_disabled"].startswith("the driver")
    got = parse_report(sent.to_json())
    assert got == sent and got.dropped_fields == []


def test_a_report_of_an_older_agent_parses_with_the_fields_unknown() -> None:
    d = doc(full())
    for key in ("vmm", "imex_channel", "extensible_disabled"):
        del d[key]
    for r in d["ranks"]:
        for key in (*RANK_FIELDS, "others"):
            del r[key]
    got = parse(d)
    assert (got.vmm, got.imex_channel, got.extensible_disabled) == (None, None, None)
    assert all(r.others == [] and all(getattr(r, k) is None for k in RANK_FIELDS) for r in got.ranks)
    assert got.dropped_fields == []


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("others_bytes", "8 GiB"),
        ("others_bytes", -1),
        ("others_bytes", True),
        ("others_bytes", 1 << 60),
        ("others_peak_bytes", 1.5),
        ("others_peak_bytes", GIB),  # below others_bytes: a peak is never under the present
        ("others", {"pid": 1}),
        ("others", [{"pid": 4242, "name": "x", "bytes": GIB}] * 2),  # the same process twice
        ("others", [{"pid": n + 1, "name": "x", "bytes": 1} for n in range(MAX_OTHERS + 1)]),
        ("others", [{"pid": 0, "name": "x", "bytes": 1}]),
        ("others", [{"pid": 9, "name": "", "bytes": 1}]),
        ("others", [{"pid": 9, "name": "x" * 65, "bytes": 1}]),
        ("others", [{"pid": 9, "name": "x", "bytes": "1"}]),
        ("others", [{"pid": 9, "name": "x", "bytes": 9 * GIB}]),  # more than others_bytes says
        ("warmup", [1, 2]),
        ("warmup", {**asdict(WARMUP), "blocks": -3}),
        ("warmup", {k: v for k, v in asdict(WARMUP).items() if k != "torch_cap_bytes"}),
        ("warmup", {**asdict(WARMUP), "free_bytes": 2.5}),
        ("free_at_load_bytes", "70 GiB"),
        ("free_at_load_bytes", -1),
        ("free_at_load_bytes", False),
        ("free_at_load_bytes", 81 * GIB),  # more than the GPU holds
        ("others_at_load_bytes", 2.5),
        ("others_at_load_bytes", 1 << 51),
        ("others_at_load_bytes", [GIB]),
    ],
)
def test_a_malformed_rank_field_is_dropped_alone_and_named(key: str, bad: Any) -> None:
    d = doc(full())
    d["ranks"][0][key] = bad
    got = parse(d)
    assert len(got.dropped_fields) == 1 and got.dropped_fields[0].startswith(f"report.ranks[0].{key}")
    sent = full().ranks[0]
    kept = {*RANK_FIELDS, "others"} - {key}
    r0 = got.ranks[0]
    assert all(getattr(r0, k) == getattr(sent, k) for k in kept), key
    assert getattr(r0, key) == ([] if key == "others" else None)
    assert got.ranks[1] == full().ranks[1] and got.vmm is True


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("vmm", "yes"),
        ("vmm", 1),
        ("imex_channel", [True]),
        ("extensible_disabled", 3),
        ("extensible_disabled", ""),
        ("extensible_disabled", "x" * 1025),
    ],
)
def test_a_malformed_pod_field_is_dropped_alone_and_named(key: str, bad: Any) -> None:
    d = doc(full())
    d[key] = bad
    got = parse(d)
    assert [f.split(":")[0] for f in got.dropped_fields] == [f"report.{key}"]
    assert getattr(got, key) is None
    assert got.ranks == full().ranks


def test_the_rest_of_the_report_is_still_checked() -> None:
    d = doc(full())
    d["ranks"][1]["free_bytes"] = -5
    with pytest.raises(ReportError):
        parse(d)


def test_a_sender_cannot_name_dropped_fields_and_several_drops_are_all_named() -> None:
    d = doc(full())
    d["dropped_fields"] = ["made up"]
    d["vmm"] = "x"
    d["ranks"][1]["warmup"] = "x"
    got = parse(d)
    assert sorted(f.split(":")[0] for f in got.dropped_fields) == ["report.ranks[1].warmup", "report.vmm"]


def test_the_load_figures_may_equal_the_gpu_and_are_each_dropped_alone() -> None:
    d = doc(full())
    d["ranks"][0]["free_at_load_bytes"] = 80 * GIB  # an empty GPU: every byte free
    d["ranks"][1]["others_at_load_bytes"] = "x"
    d["ranks"][1]["free_at_load_bytes"] = 60 * GIB
    got = parse(d)
    assert [f.split(":")[0] for f in got.dropped_fields] == ["report.ranks[1].others_at_load_bytes"]
    assert (got.ranks[0].free_at_load_bytes, got.ranks[0].others_at_load_bytes) == (80 * GIB, 8 * GIB)
    assert (got.ranks[1].free_at_load_bytes, got.ranks[1].others_at_load_bytes) == (60 * GIB, None)
