"""`reconcile.step` and what it learns about the engine: the GPU's size (from reports and from
start-up refusals), vLLM's own per-worker memory report, its version and the rules that apply,
the free memory its start-up check saw, and the engine lines the agents could not read."""

from __future__ import annotations

from dataclasses import replace

from rankguard_agent.wire import termination as tm
from rankguard_agent.wire.report import Report
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB
from tests.unit.reconcile_world import (
    SPEC,
    Cluster,
    flags_of,
    pod,
    report,
    running,
    vllm_argv,
)


def test_without_gpu_memory_bytes_the_gpu_size_is_learned_and_the_startup_check_fits() -> None:
    """Nobody types the GPU's size: the agents' first report gives it, status keeps it, and the
    byte budget that follows is rendered with a start-up utilisation that fits the card."""
    c = Cluster()
    del c.spec["memory"]
    c.run()
    assert c.deployment is not None
    assert "--kv-cache-memory-bytes" not in vllm_argv(c.deployment)  # no size, no plan yet
    c.controller_done()
    small = 24 * GiB

    def small_card_report(at: float) -> Report:
        r = report((12 * GiB, 12 * GiB), at)
        return replace(
            r, ranks=[replace(s, total_bytes=small, used_bytes=small - s.free_bytes) for s in r.ranks]
        )

    pod_name = c.pods[0]["metadata"]["name"]
    for _ in range(3):
        c.run(reports=((pod_name, small_card_report(c.clock), c.clock),))
        c.controller_done()
    assert c.status["gpuMemoryBytes"] == small
    argv = vllm_argv(c.deployment)
    assert "--kv-cache-memory-bytes" in argv, argv
    util = float(argv[argv.index("--gpu-memory-utilization") + 1])
    kv = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    assert kv / small < util < 0.92  # what vLLM will use, not its default 0.92 of the card
    # the learned size survives a restart of the operator: it is read back from status
    assert c.state().gpu_memory_bytes == small


def _with_engine(r: Report, *, version: str | None, rank0_others: int) -> Report:
    """The report of a first start in utilisation mode: vLLM printed its per-worker memory report
    (another CUDA context held `rank0_others` bytes on GPU 0 when the workers started)."""
    from rankguard_agent.wire.report import EngineMemory

    def mem(rank: int) -> EngineMemory:
        return EngineMemory(
            consumed_bytes=9 * GiB,
            peak_activation_bytes=2 * GiB,
            cuda_graph_bytes=GiB // 2,
            kv_in_use_bytes=60 * GiB,
            free_at_start_bytes=80 * GiB - (rank0_others if rank == 0 else 0) - GiB // 4,
            total_bytes=80 * GiB,
            requested_bytes=int(80 * GiB * 0.92),
        )

    return replace(r, engine_version=version, ranks=[replace(s, engine_memory=mem(s.rank)) for s in r.ranks])


def test_the_engines_own_report_tightens_the_plan_and_survives_a_restart_without_it() -> None:
    c = running()
    pod_name = c.pods[0]["metadata"]["name"]
    before = c.state()
    c.run(
        reports=(
            (
                pod_name,
                _with_engine(report((20 * GiB, 20 * GiB), c.clock), version="0.33.0", rank0_others=6 * GiB),
                c.clock,
            ),
        )
    )
    engine = c.status["engine"]
    assert (
        engine["version"] == "0.33.0" and engine["versionSource"] == "agent" and engine["rules"] == "0.33.0"
    )
    rows = {r["rank"]: r for r in engine["ranks"]}
    # others' 6.25 GiB on GPU 0 + 9 + 2 + 0.5 GiB of the worker's own: the engine's figure
    assert rows[0]["nonKVBytes"] == 6 * GiB + GiB // 4 + 9 * GiB + 2 * GiB + GiB // 2
    assert rows[1]["nonKVBytes"] == GiB // 4 + 9 * GiB + 2 * GiB + GiB // 2
    rules = next(x for x in c.status["conditions"] if x["type"] == "EngineRules")
    assert (rules["status"], rules["reason"]) == ("True", "Recorded")
    assert before.engine_non_kv == {} and c.state().engine_non_kv == {
        0: rows[0]["nonKVBytes"],
        1: rows[1]["nonKVBytes"],
    }
    # the bottleneck's engine figure (others' memory on GPU 0 included) tightens the plan
    from rankguard_operator.core.budget.bounds import measured_plan
    from rankguard_operator.core.observe.headroom import aggregate, gpu_totals

    obs = aggregate([(pod_name, report((20 * GiB, 20 * GiB), c.clock), c.clock)], c.clock, 30.0)
    spec = parse_spec(SPEC)
    with_engine = measured_plan(spec, gpu_totals(obs, c.state().engine_non_kv))
    without = measured_plan(spec, gpu_totals(obs))
    assert with_engine is not None and without is not None
    assert with_engine.ranks[0].non_kv_source == "engine"
    assert with_engine.kv_cache_memory_bytes < without.kv_cache_memory_bytes
    # a later pod (byte budget: vLLM prints no report) keeps the figures from status
    c.run(reports=((pod_name, report((20 * GiB, 20 * GiB), c.clock), c.clock),))
    assert c.state().engine_non_kv[0] == rows[0]["nonKVBytes"]


def test_an_unknown_engine_version_falls_back_to_the_nearest_snapshot_and_says_so() -> None:
    c = running()
    pod_name = c.pods[0]["metadata"]["name"]
    r = _with_engine(report((20 * GiB, 20 * GiB), c.clock), version="0.99.1", rank0_others=0)
    step = c.run(reports=((pod_name, r, c.clock),))
    assert step.decision is not None  # the operator carries on
    rules = next(x for x in c.status["conditions"] if x["type"] == "EngineRules")
    assert (rules["status"], rules["reason"]) == ("False", "NearestSnapshot")
    from rankguard_operator import vllm_snapshots

    newest = vllm_snapshots.latest().version
    assert "0.99.1" in rules["message"] and newest in rules["message"]
    assert c.status["engine"]["rules"] == newest


def test_a_start_up_refusal_teaches_the_gpu_size_when_no_report_could() -> None:
    """vLLM's start-up check refuses a small card under TP before the pod is ever ready (no
    report to scrape): the termination message's device total is learned, and the roll that
    follows carries a start-up utilisation that fits."""
    c = Cluster()
    del c.spec["memory"]
    c.run()
    c.controller_done()
    p = c.pods[0]
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=1,
        gpu_index=1,
        requested_bytes=int(15 * GiB * 0.92),
        free_bytes=13 * GiB,
        total_bytes=15 * GiB,
        detail="vLLM refused to start: its start-up memory check failed on cuda:1",
    ).to_json()
    term = {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}
    c.pods = [pod(p["metadata"]["name"], p["metadata"]["annotations"], ready=False, terminated=term)]
    c.run()
    assert c.status["gpuMemoryBytes"] == 15 * GiB
    argv = vllm_argv(c.deployment)
    assert "--kv-cache-memory-bytes" in argv, argv
    assert float(argv[argv.index("--gpu-memory-utilization") + 1]) < 13 / 15


def test_a_start_up_refusal_under_a_byte_budget_keeps_the_budget_and_lowers_the_checked_share() -> None:
    """vLLM's start-up check compares free memory with the utilisation rendered next to the
    budget, not with the budget: the budget stays, and the utilisation drops under what vLLM
    measured (kept in status, so the next render and a restarted operator agree)."""
    c = running()
    before = flags_of(c.deployment)
    util_before = float(
        vllm_argv(c.deployment)[vllm_argv(c.deployment).index("--gpu-memory-utilization") + 1]
    )
    p = c.pods[0]
    free = int(util_before * 80 * GiB) - 3 * GiB
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=0,
        gpu_index=0,
        requested_bytes=int(util_before * 80 * GiB),
        free_bytes=free,
        total_bytes=80 * GiB,
        detail="vLLM refused to start: its start-up memory check failed on cuda:0",
        startup_check=True,
    ).to_json()
    term = {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}
    c.pods = [pod(p["metadata"]["name"], p["metadata"]["annotations"], ready=False, terminated=term)]
    step = c.run()
    assert step.decision is not None and step.decision.reason == "StartupCheckRefused"
    assert flags_of(c.deployment) == before  # the KV budget stays
    argv = vllm_argv(c.deployment)
    util = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert util * 80 * GiB <= free - 512 * 1024 * 1024
    assert c.status["engine"]["startupFreeBytes"] == free
    assert any(e.reason == "StartupCheckRefused" for e in c.events.values())
    assert not c.status.get("remediations")  # no budget change to record
    # a restarted operator renders the same thing: nothing more to roll
    applies = len(c.deployments_applied)
    c.controller_done()
    c.run()
    assert len(c.deployments_applied) == applies


def _external_weights_line(util: float, weights: int) -> str:
    """vLLM 0.33's refusal, rendered from the recorded snapshot as a worker prints it."""
    from rankguard_operator import vllm_snapshots

    [msg] = vllm_snapshots.latest().messages("startup_external_weights")
    total = 80 * GiB
    text = msg["template"].format(
        "cuda:0", round(weights / GiB, 2), round(total / GiB, 2), util, round(util * total / GiB, 2)
    )
    return f"(Worker_TP0 pid=80) ERROR 12-01 10:00:00 [utils.py:{msg['line']}] ValueError: {text}"


def test_an_external_weights_refusal_keeps_the_budget_and_raises_the_checked_share() -> None:
    """Weights another process holds on the GPU reached the utilisation rendered next to the
    byte budget: vLLM allocated nothing, so the budget stays, and the utilisation rises above
    those weights (kept in status, so the next render and a restarted operator agree). The kubelet's
    log tail (a launcher that died before writing its message) says the same as the agent."""
    for how in ("message", "log tail"):
        c = running()
        before = flags_of(c.deployment)
        argv = vllm_argv(c.deployment)
        util_before = float(argv[argv.index("--gpu-memory-utilization") + 1])
        weights = int(util_before * 80 * GiB) + 2 * GiB
        assert weights < 78 * GiB
        line = _external_weights_line(util_before, weights)
        if how == "message":
            message = tm.TerminationMessage(
                reason=tm.CUDA_OOM,
                exit_code=1,
                rank=0,
                gpu_index=0,
                requested_bytes=int(util_before * 80 * GiB),
                total_bytes=80 * GiB,
                detail=line,
                startup_check=True,
                external_weight_bytes=weights,
            ).to_json()
        else:
            message = f"INFO 12-01 09:59:59 [gpu_worker.py:1] Loading weights\n{line}\n"
        term = {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}
        p = c.pods[0]
        c.pods = [pod(p["metadata"]["name"], p["metadata"]["annotations"], ready=False, terminated=term)]
        step = c.run()
        assert step.decision is not None and step.decision.reason == "ExternalWeightsRefused", how
        assert flags_of(c.deployment) == before  # the KV budget stays: nothing was allocated
        argv = vllm_argv(c.deployment)
        util = float(argv[argv.index("--gpu-memory-utilization") + 1])
        kept = c.status["engine"]["externalWeightBytes"]
        assert abs(kept - weights) <= GiB // 200 + 1  # the log line's figure is 0.01 GiB precise
        assert util * 80 * GiB >= kept + 512 * 1024 * 1024 > util_before * 80 * GiB
        assert any(e.reason == "ExternalWeightsRefused" for e in c.events.values())
        assert not c.status.get("remediations")  # no budget change to record
        applies = len(c.deployments_applied)
        c.controller_done()
        c.run()
        assert len(c.deployments_applied) == applies


def test_engine_lines_the_agents_could_not_read_are_said_in_the_condition() -> None:
    c = running()
    pod_name = c.pods[0]["metadata"]["name"]
    r = replace(report((20 * GiB, 20 * GiB), c.clock), engine_version="0.33.0")
    r = replace(r, unparsed_lines={"worker_memory_report": 2})
    step = c.run(reports=((pod_name, r, c.clock),))
    assert step.decision is not None
    rules = next(x for x in c.status["conditions"] if x["type"] == "EngineRules")
    assert (rules["status"], rules["reason"]) == ("False", "UnreadEngineLines")
    assert "worker_memory_report 2" in rules["message"]
    assert "engine" in c.status and "ranks" not in c.status["engine"]  # nothing unread is used
