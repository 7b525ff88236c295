"""/report and /metrics on a pod of a vLLM multi-node group: every rank is vLLM's global rank, with
the pod's place (`nnodes`, `node_rank`, `local_world_size`, `tp_size`, `pp_size`) and per rank its
`local_rank`, `stage` and `tp_rank`, which `parse_report` checks against each other. A report
without them (one node, or an older agent) parses as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rankguard_agent.gpu.sim import SimBackend
from rankguard_agent.gpu.simfiles import write_device
from rankguard_agent.sampler import Sampler
from rankguard_agent.server import AgentCollector, AgentState
from rankguard_agent.wire.group import MAX_RANKS, GroupPlace
from rankguard_agent.wire.report import (
    EngineMemory,
    ProbeRank,
    ProbeResult,
    RankSample,
    Report,
    ReportError,
    parse_report,
)

GIB = 1 << 30
# TP8 x PP2 over two pods of 8 GPUs; this is pod 1: global ranks 8..15, stage 1
POD1 = GroupPlace(nnodes=2, node_rank=1, tp=8, pp=2, local_world=8)


def sample(local: int, place: GroupPlace = POD1, **kw: Any) -> RankSample:
    rank = place.global_rank(local)
    base: dict[str, Any] = {
        "rank": rank,
        "uuid": f"GPU-{local}",
        "total_bytes": 80 * GIB,
        "used_bytes": 40 * GIB,
        "free_bytes": 40 * GIB,
        "min_free_bytes": 39 * GIB,
        "window_seconds": 60.0,
        "local_rank": local,
        "stage": place.stage(rank),
        "tp_rank": place.tp_rank(rank),
    }
    base.update(kw)
    return RankSample(**base)


def group_report(place: GroupPlace = POD1, n: int = 8, **kw: Any) -> Report:
    base: dict[str, Any] = {
        "version": 1,
        "agent_version": "t",
        "timestamp": 1.0,
        "ranks": [sample(i, place) for i in range(n)],
        "nnodes": place.nnodes,
        "node_rank": place.node_rank,
        "local_world_size": place.local_world,
        "tp_size": place.tp,
        "pp_size": place.pp,
    }
    base.update(kw)
    return Report(**base)


def doc(r: Report) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(r.to_json())
    return out


def parse(d: dict[str, Any]) -> Report:
    return parse_report(json.dumps(d).encode())


def test_a_group_report_round_trips_with_global_ranks() -> None:
    probe = ProbeResult(
        ok=True,
        backend="nccl",
        world_size=8,
        ranks=[ProbeRank(8 + i, 80 * GIB, 78 * GIB, 2 * GIB, local_rank=i) for i in range(8)],
    )
    sent = group_report(probe=probe)
    d = doc(sent)
    assert (d["nnodes"], d["node_rank"], d["local_world_size"], d["tp_size"], d["pp_size"]) == (2, 1, 8, 8, 2)
    assert [(r["rank"], r["local_rank"], r["stage"], r["tp_rank"]) for r in d["ranks"]][3] == (11, 3, 1, 3)
    assert d["probe"]["ranks"][0]["rank"] == 8 and d["probe"]["ranks"][0]["local_rank"] == 0
    got = parse_report(sent.to_json())
    assert got == sent
    assert [r.rank for r in got.ranks] == list(range(8, 16))


@pytest.mark.parametrize(
    "place",
    [
        GroupPlace(2, 0, 8, 2, 8),
        GroupPlace(2, 1, 4, 4, 8),  # two stages on each pod
        GroupPlace(4, 3, 2, 4, 2),
        GroupPlace(2, 1, 16, 1, 8),  # one TP group across the pods
        GroupPlace(64, 63, 64, 64, 64),  # the largest group: ranks up to 4095
    ],
)
def test_every_layout_parses(place: GroupPlace) -> None:
    sent = group_report(place, n=place.local_world)
    assert parse_report(sent.to_json()) == sent


def test_an_older_report_parses_as_one_node() -> None:
    old = {
        "version": 1,
        "agent_version": "0.1.0",
        "timestamp": 1.0,
        "ranks": [
            {
                "rank": i,
                "uuid": f"GPU-{i}",
                "total_bytes": 80 * GIB,
                "used_bytes": 40 * GIB,
                "free_bytes": 40 * GIB,
                "min_free_bytes": 39 * GIB,
                "window_seconds": 60.0,
                "error": None,
            }
            for i in range(2)
        ],
        "probe": {
            "ok": True,
            "backend": "nccl",
            "world_size": 2,
            "ranks": [{"rank": 1, "free_before_bytes": 1, "free_after_bytes": 1, "comm_bytes": 0}],
            "duration_seconds": 1.0,
        },
    }
    got = parse(old)
    assert (got.nnodes, got.node_rank, got.local_world_size, got.tp_size, got.pp_size) == (None,) * 5
    assert [(r.rank, r.local_rank, r.stage, r.tp_rank) for r in got.ranks] == [
        (0, None, None, None),
        (1, None, None, None),
    ]
    assert got.probe is not None and got.probe.ranks[0].local_rank is None
    # what one node could not say before, it still cannot: rank 8 of a report that is not a group's
    old["ranks"][1]["rank"] = 8
    with pytest.raises(ReportError, match=r"ranks must be 0\.\.N-1"):
        parse(old)
    old["ranks"][1]["rank"] = MAX_RANKS
    with pytest.raises(ReportError, match=r"outside \[0, 63\]"):
        parse(old)


def test_one_node_reports_carry_no_group_fields() -> None:
    one = Report(1, "t", 1.0, [RankSample(0, "GPU-0", 100, 50, 50, 40, 10.0)])
    d = doc(one)
    assert all(d[k] is None for k in ("nnodes", "node_rank", "local_world_size", "tp_size", "pp_size"))
    assert parse_report(one.to_json()) == one


def _bad(d: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    target: Any = d
    *parents, last = path.split(".")
    for p in parents:
        target = target[int(p)] if p.isdigit() else target[p]
    target[last] = value
    return d


@pytest.mark.parametrize(
    ("path", "value", "why"),
    [
        ("node_rank", -1, "node_rank"),
        ("node_rank", 2, "not one of the group's 0..1"),
        ("node_rank", "1", "expected an integer"),
        ("node_rank", True, "expected an integer"),
        ("node_rank", None, "nnodes and node_rank come together"),
        ("nnodes", None, "nnodes and node_rank come together"),
        ("nnodes", 0, "nnodes"),
        ("nnodes", 65, "nnodes"),
        ("local_world_size", 0, "local_world_size"),
        ("local_world_size", 65, "local_world_size"),
        ("tp_size", 3, "does not divide the group's 16 ranks"),
        ("pp_size", 0, "pp_size"),
        ("ranks.3.rank", 3, r"not node_rank 1 x local_world_size 8 \+ local_rank 3"),
        ("ranks.3.rank", 16, r"outside \[0, 15\]"),  # beyond the group's 16 ranks
        ("ranks.3.rank", -1, "rank"),
        ("ranks.3.local_rank", 8, r"outside \[0, 7\]"),
        ("ranks.3.local_rank", -1, "local_rank"),
        ("ranks.3.local_rank", 4, "not node_rank 1"),
        ("ranks.3.local_rank", None, "local_rank is said on some ranks and not on others"),
        ("ranks.3.stage", 2, r"stage: 2 is outside \[0, 1\]"),  # stage >= pp_size
        ("ranks.3.stage", 0, "stage 0 is not rank 11's"),
        ("ranks.3.stage", -1, "stage"),
        ("ranks.3.tp_rank", 8, r"tp_rank: 8 is outside \[0, 7\]"),
        ("ranks.3.tp_rank", 4, "tp_rank 4 is not rank 11 mod tp_size 8"),
        ("ranks.3.tp_rank", 3.0, "expected an integer"),
        ("probe.ranks.0.rank", 0, "not node_rank 1"),
        ("probe.ranks.0.local_rank", 64, r"outside \[0, 63\]"),
    ],
)
def test_bad_group_fields_reject_the_report(path: str, value: Any, why: str) -> None:
    probe = ProbeResult(ok=True, backend="nccl", world_size=8, ranks=[ProbeRank(8, 1, 1, 0, local_rank=0)])
    d = _bad(doc(group_report(probe=probe)), path, value)
    with pytest.raises(ReportError, match=why):
        parse(d)


def test_a_group_report_may_leave_the_local_ranks_to_the_reader() -> None:
    d = doc(group_report())
    for r in d["ranks"]:
        r["local_rank"] = r["stage"] = r["tp_rank"] = None
    got = parse(d)
    assert [r.rank for r in got.ranks] == list(range(8, 16))
    d["ranks"][0]["rank"] = 0  # pod 1 has no global rank 0
    with pytest.raises(ReportError, match=r"ranks must be 8\.\.8\+N-1"):
        parse(d)


def test_local_ranks_must_be_the_pods_gpus_each_once() -> None:
    d = doc(group_report(n=2))
    d["ranks"][1].update(rank=8, local_rank=0, tp_rank=0)  # two of local rank 0
    with pytest.raises(ReportError, match=r"local ranks must be 0\.\.N-1, each once"):
        parse(d)
    # without the pod's place, the offset must still be one for the whole pod
    d = doc(group_report(n=2))
    for key in ("nnodes", "node_rank", "local_world_size", "tp_size", "pp_size"):
        d[key] = None
    d["ranks"][1].update(rank=20)
    with pytest.raises(ReportError, match="rank - local_rank must be the same"):
        parse(d)
    d["ranks"][1].update(rank=10)
    with pytest.raises(ReportError, match="rank - local_rank must be the same"):
        parse(d)


# -- the agent's own /report and /metrics on a worker pod --------------------------------------


@pytest.fixture
def four_gpu_state(tmp_path: Path) -> AgentState:
    for i in range(4):
        write_device(tmp_path, f"GPU-{i}", index=i, total_bytes=80 * GIB)
    sampler = Sampler(SimBackend(tmp_path, {}), hz=10, window_seconds=30)
    sampler.sample_once()
    return AgentState(sampler=sampler, backend_name="sim")


def test_the_agent_reports_its_gpus_by_global_rank(four_gpu_state: AgentState) -> None:
    state = four_gpu_state
    state.place = GroupPlace(nnodes=2, node_rank=1, tp=4, pp=2, local_world=4)  # TP4 x PP2 over 2 pods
    state.record_engine_memory(2, EngineMemory(consumed_bytes=16 * GIB))  # the pod's GPU 2
    report = parse_report(state.report().to_json())
    assert (report.nnodes, report.node_rank, report.local_world_size, report.tp_size, report.pp_size) == (
        2,
        1,
        4,
        4,
        2,
    )
    assert [(r.rank, r.local_rank, r.stage, r.tp_rank, r.uuid) for r in report.ranks] == [
        (4, 0, 1, 0, "GPU-0"),
        (5, 1, 1, 1, "GPU-1"),
        (6, 2, 1, 2, "GPU-2"),
        (7, 3, 1, 3, "GPU-3"),
    ]
    assert [r.rank for r in report.ranks if r.engine_memory is not None] == [6]
    assert metric_ranks(state, "rankguard_gpu_free_bytes") == ["4", "5", "6", "7"]


def test_a_gpu_beyond_the_pods_share_is_no_rank(four_gpu_state: AgentState) -> None:
    state = four_gpu_state
    state.place = GroupPlace(nnodes=2, node_rank=1, tp=2, pp=2, local_world=2)  # vLLM runs 2 per pod
    report = parse_report(state.report().to_json())
    assert [(r.rank, r.local_rank) for r in report.ranks] == [(2, 0), (3, 1)]
    assert metric_ranks(state, "rankguard_gpu_up") == ["2", "3"]


def test_one_node_state_reports_as_before(four_gpu_state: AgentState) -> None:
    report = parse_report(four_gpu_state.report().to_json())
    assert [(r.rank, r.local_rank, r.stage) for r in report.ranks] == [(i, None, None) for i in range(4)]
    assert report.nnodes is None


def metric_ranks(state: AgentState, name: str) -> list[str]:
    """The `rank` labels of one metric as /metrics exposes it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(state))
    return [
        s.labels["rank"]
        for fam in text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
        if s.name == name
    ]
