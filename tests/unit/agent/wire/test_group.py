"""The agent on a pod of a vLLM multi-node group (`--nnodes N --node-rank R`): the rank layout
(`wire.group`), reading the group from the `vllm serve` argv, which global rank a worker's line is
from, and the termination message that names the failed rank by its global number."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rankguard_agent.launcher import Observer
from rankguard_agent.server import AgentState
from rankguard_agent.verdict import termination_message
from rankguard_agent.wire.group import (
    SINGLE_NODE,
    GroupPlace,
    flag_values,
    read_group,
)
from rankguard_agent.wire.recognisers import CudaOom, recognise
from rankguard_agent.wire.termination import (
    CUDA_OOM,
    ENGINE_ERROR,
    MAX_TERMINATION_BYTES,
    TerminationError,
    TerminationMessage,
    parse_termination_message,
)
from rankguard_agent.workers import WorkerRanks, parallel_sizes

GIB = 1 << 30
SERVE = ["vllm", "serve", "meta-llama/Llama-3.1-70B"]
REPORT_LINE = (
    "INFO 12-01 10:00:00 [gpu_worker.py:1045] Free memory on device (78.5/79.19 GiB) on startup. Desired GPU "
    "memory utilization is (0.9, 71.27 GiB). Actual usage is 16.0 GiB for consumed memory (weights + "
    "non-torch), 3.0 GiB for peak activation, and 0.5 GiB for CUDAGraph memory. Replace "
    "gpu_memory_utilization config with `--kv-cache-memory=55534633369` (51.72 GiB) to fit into requested "
    "memory, or `--kv-cache-memory=62912306053` (58.59 GiB) to fully utilize gpu memory. Current kv cache "
    "memory in use is 51.77 GiB."
)
OOM = (
    "ERROR 10-02 12:00:01 [multiproc_executor.py:1189] torch.OutOfMemoryError: CUDA out of memory. Tried to "
    "allocate 2.00 GiB. GPU {gpu} has a total capacity of 79.19 GiB of which 1.06 GiB is free. Including "
    "non-PyTorch memory, this process has 78.12 GiB memory in use. Of the allocated memory 75.50 GiB is "
    "allocated by PyTorch, and 1.25 GiB is reserved by PyTorch but unallocated."
)
STARTUP = (
    "ERROR 10-02 12:00:00 [multiproc_executor.py:1057] ValueError: Free memory on device cuda:{gpu} "
    "(1.5/79.19 GiB) on startup is less than desired GPU memory utilization (0.9, 71.27 GiB). Decrease GPU "
    "memory utilization or reduce GPU memory used by other processes."
)


def place(argv: str) -> GroupPlace:
    found, problem = read_group([*SERVE, *argv.split()])
    assert problem is None, problem
    return found


# -- the rank layout -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "local", "rank", "stage", "tp_rank"),
    [
        # TP8 x PP2 over 2 pods of 8: pod 1 is stage 1
        (GroupPlace(2, 1, 8, 2, 8), 3, 11, 1, 3),
        (GroupPlace(2, 0, 8, 2, 8), 7, 7, 0, 7),
        (GroupPlace(2, 1, 8, 2, 8), 0, 8, 1, 0),
        # TP4 x PP4 over 2 pods of 8: each pod holds two stages
        (GroupPlace(2, 0, 4, 4, 8), 5, 5, 1, 1),
        (GroupPlace(2, 1, 4, 4, 8), 0, 8, 2, 0),
        (GroupPlace(2, 1, 4, 4, 8), 7, 15, 3, 3),
        # TP16 over 2 pods of 8 (one stage split across pods)
        (GroupPlace(2, 1, 16, 1, 8), 2, 10, 0, 10),
        # TP2 x PP4 over 4 pods of 2: one stage per pod
        (GroupPlace(4, 3, 2, 4, 2), 1, 7, 3, 1),
        # TP4 x PP2 over 8 pods of one GPU
        (GroupPlace(8, 5, 4, 2, 1), 0, 5, 1, 1),
        # TP2 x PCP2 x PP2 over 2 pods of 4: stage = global // (TP x PCP)
        (GroupPlace(2, 1, 2, 2, 4, pcp=2), 1, 5, 1, 1),
    ],
)
def test_global_rank_stage_and_tp_rank(
    group: GroupPlace, local: int, rank: int, stage: int, tp_rank: int
) -> None:
    assert group.global_rank(local) == rank
    assert group.local_rank(rank) == local
    assert group.node_of(rank) == group.node_rank
    assert (group.stage(rank), group.tp_rank(rank)) == (stage, tp_rank)


def test_a_rank_of_another_pod_has_no_local_rank_here() -> None:
    pod1 = GroupPlace(2, 1, 8, 2, 8)
    assert [pod1.local_rank(r) for r in (7, 8, 15, 16, -1)] == [None, 0, 7, None, None]
    assert pod1.node_of(7) == 0
    # one node: every GPU is its own rank, whatever the sizes say (the agent reports all it sees)
    assert [SINGLE_NODE.local_rank(r) for r in (0, 5, -1)] == [0, 5, None]
    assert SINGLE_NODE.global_rank(3) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"nnodes": 0},
        {"nnodes": 65, "local_world": 1, "tp": 65},
        {"nnodes": 2, "node_rank": 2, "tp": 4, "local_world": 2},
        {"nnodes": 2, "node_rank": -1, "tp": 4, "local_world": 2},
        {"nnodes": 2, "tp": 4, "local_world": 4},  # 2 x 4 is not TP 4
        {"nnodes": 2, "tp": 4, "local_world": 0},
        {"nnodes": 2, "tp": 0, "local_world": 1},
    ],
)
def test_a_place_that_cannot_be_is_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        GroupPlace(**kwargs)


# -- reading the group from vLLM's argv --------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        "--tensor-parallel-size 8 --pipeline-parallel-size 2 --nnodes 2 --node-rank 1",
        "-tp 8 -pp 2 -n 2 -r 1",
        "-tp=8 -pp=2 -n=2 -r=1",
        "--tensor-parallel-size=8 --pipeline-parallel-size=2 --nnodes=2 --node-rank=1",
        "--tensor_parallel_size 8 --pipeline_parallel_size=2 --nnodes 2 --node_rank 1",  # vLLM turns _ into -
        "-tp 8 -pp 2 -n2 -r1",  # argparse: a one-letter short option joined to its value
        "-tp 8 -pp 2 --nnodes 4 --nnodes 2 --node-rank 0 --node-rank 1 --headless",  # the last one wins
        "--master-addr leader.svc --master-port 29501 -tp 8 -pp 2 --nnodes 2 --node-rank 1 --headless",
    ],
)
def test_every_spelling_of_the_group(argv: str) -> None:
    assert place(argv) == GroupPlace(nnodes=2, node_rank=1, tp=8, pp=2, local_world=8)


def test_defaults_are_a_single_node() -> None:
    assert read_group(SERVE) == (SINGLE_NODE, None)
    assert read_group([*SERVE, "-tp", "8"]) == (SINGLE_NODE, None)
    assert read_group([*SERVE, "--nnodes", "1", "--node-rank", "0"]) == (SINGLE_NODE, None)
    # a size rankguard cannot read on one node changes nothing there (vLLM will say it)
    assert read_group([*SERVE, "-tp", "x"]) == (SINGLE_NODE, None)


def test_prefill_context_parallelism_is_part_of_the_world() -> None:
    found = place("-tp 2 -pcp 2 -pp 2 --nnodes 2 --node-rank 1")
    assert (found.local_world, found.pcp, found.global_rank(0)) == (4, 2, 4)


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        ("-tp 8 --nnodes 2 --node-rank x", "--node-rank 'x' is not a number"),
        ("-tp 8 --nnodes two --node-rank 1", "--nnodes 'two' is not a number"),
        ("-tp 8 --nnodes 2 --node-rank", "--node-rank '' is not a number"),
        ("-tp 8 --nnodes 2 --node-rank $(RANKGUARD_NODE_RANK)", "is not a number"),  # not expanded
        ("-tp 8 --nnodes 2 --node-rank -1", "is not a number"),
        ("-tp eight --nnodes 2 --node-rank 1", "--tensor-parallel-size 'eight' is not a number"),
        ("-tp 8 --nnodes 2 --node-rank 2", "node rank 2 is not one of 0..1"),
        ("-tp 3 --nnodes 2 --node-rank 1", "3 ranks do not split evenly over 2 nodes"),
        ("-tp 8 --nnodes 0", "nnodes 0 is outside"),
        ("-tp 128 --nnodes 1 --node-rank 1", "--node-rank 1 of a single node"),
        ("-tp 8 -dp 2 --nnodes 2 --node-rank 1", "data parallelism across nodes"),
        ("-tp 8192 --nnodes 64 --node-rank 1", "128 ranks per pod is outside 1..64"),
    ],
)
def test_a_malformed_group_is_a_single_node_and_says_why(argv: str, why: str) -> None:
    found, problem = read_group([*SERVE, *argv.split()])
    assert found == SINGLE_NODE
    assert problem is not None and why in problem


def test_the_operators_node_rank_is_checked_against_vllms() -> None:
    argv = [*SERVE, "-tp", "4", "--nnodes", "2", "--node-rank", "1"]
    assert read_group(argv, {"RANKGUARD_NODE_RANK": "1"}) == (place("-tp 4 --nnodes 2 --node-rank 1"), None)
    found, problem = read_group(argv, {"RANKGUARD_NODE_RANK": "0"})
    assert found.node_rank == 1  # vLLM runs what its argv says
    assert problem is not None and "RANKGUARD_NODE_RANK" in problem


def test_flag_values_stop_at_a_bare_double_dash_and_skip_other_options() -> None:
    flags = {"--nnodes": "n", "-r": "r"}
    argv = ["--nnodes-extra", "3", "-rx", "--nnodes", "2", "-q", "fp8", "--", "--nnodes", "9"]
    assert list(flag_values(argv, flags)) == [("r", "x"), ("n", "2")]


# -- which global rank a line is from, on a worker pod ----------------------------------------


POD1 = "-tp 8 -pp 2 --nnodes 2 --node-rank 1 --headless"  # global ranks 8..15, stage 1


def ranks_on(argv: str, n_ranks: int = 8) -> WorkerRanks:
    full = [*SERVE, *argv.split()]
    return WorkerRanks(parallel_sizes(full), n_ranks, read_group(full)[0])


@pytest.mark.parametrize(
    ("who", "rank"),
    [
        ("(Worker_PP1_TP3 pid=1) ", 11),
        ("(Worker_PP1_TP0 pid=1) ", 8),
        ("\x1b[0;36m(Worker_PP1_TP7 pid=1)\x1b[0;0m ", 15),  # vLLM's coloured prefix
        ("(Worker_PP0_TP3 pid=1) ", None),  # pod 0's worker: not one of this pod's ranks
        ("(Worker_PP1_TP8 pid=1) ", None),  # an index outside its group
        ("(Worker pid=1) ", None),  # before vLLM names it, with no device in the line
        ("(EngineCore_DP0 pid=9) ", None),
        ("(APIServer pid=9) ", None),
        ("", None),
    ],
)
def test_rank_of_a_worker_line_on_a_worker_pod(who: str, rank: int | None) -> None:
    assert ranks_on(POD1).rank_of(who + REPORT_LINE) == rank


def test_tp_across_pods_names_the_global_tp_rank() -> None:
    # TP16 over two pods: pod 1's workers are TP8..TP15
    ranks = ranks_on("-tp 16 --nnodes 2 --node-rank 1")
    assert ranks.rank_of("(Worker_TP10 pid=1) " + REPORT_LINE) == 10
    assert ranks.rank_of("(Worker_TP2 pid=1) " + REPORT_LINE) is None
    # TP4 x PP4 over two pods: pod 1 runs stages 2 and 3
    ranks = ranks_on("-tp 4 -pp 4 --nnodes 2 --node-rank 1")
    assert ranks.rank_of("(Worker_PP3_TP1 pid=1) " + REPORT_LINE) == 13
    assert ranks.rank_of("(Worker_PP1_TP1 pid=1) " + REPORT_LINE) is None


def test_a_gpu_the_agent_does_not_see_is_not_guessed() -> None:
    assert ranks_on(POD1, n_ranks=4).rank_of("(Worker_PP1_TP5 pid=1) " + REPORT_LINE) is None
    assert ranks_on(POD1, n_ranks=0).rank_of("(Worker_PP1_TP5 pid=1) " + REPORT_LINE) == 13  # no readings


@pytest.mark.parametrize(
    ("line", "rank"),
    [
        ("(Worker_PP1_TP3 pid=1) " + OOM.format(gpu=3), 11),
        # the worker's label names the rank, whatever index the process's CUDA gave its device
        ("(Worker_PP1_TP3 pid=1) " + OOM.format(gpu=0), 11),
        # vLLM's start-up check runs before the worker is named: its device is this pod's GPU 2
        ("(Worker pid=1) " + STARTUP.format(gpu=2), 10),
        ("(Worker pid=1) " + OOM.format(gpu=6), 14),
        # the leader's engine core repeats a worker's error: that GPU index may be another pod's
        (
            "(EngineCore_DP0 pid=9) ERROR RuntimeError: Worker failed with error '"
            + OOM.format(gpu=1)
            + "', please check the stack trace above for the root cause",
            None,
        ),
        (
            "RuntimeError: Worker failed with error '" + OOM.format(gpu=1) + "'",
            None,
        ),  # its traceback, unprefixed
        ("(Worker pid=1) " + OOM.format(gpu=9), None),  # not one of the pod's 8 GPUs
    ],
)
def test_rank_of_an_oom_on_a_worker_pod(line: str, rank: int | None) -> None:
    found = recognise(line)
    assert isinstance(found, CudaOom) and found.gpu_index is not None
    assert ranks_on(POD1).rank_of_oom(line, found.gpu_index) == rank


def test_on_one_node_the_oom_rank_is_the_device_index_as_before() -> None:
    ranks = ranks_on("-tp 8")
    assert ranks.rank_of_oom("(EngineCore_DP0 pid=9) " + OOM.format(gpu=3), 3) == 3
    assert ranks.rank_of_oom(OOM.format(gpu=9), 9) is None
    assert ranks.rank_of("(Worker_TP3 pid=1) " + REPORT_LINE) == 3


# -- the observer keeps engine figures by local GPU, and the failed rank -----------------------


class _NoSampler:
    def snapshot(self) -> list[Any]:
        return []


def test_the_observer_files_engine_figures_under_the_local_gpu() -> None:
    state = AgentState(sampler=_NoSampler(), backend_name="test")  # type: ignore[arg-type]
    obs = Observer(state, ranks_on(POD1))
    obs.on_line("(Worker_PP1_TP3 pid=77) " + REPORT_LINE)
    obs.on_line("(Worker_PP0_TP3 pid=77) " + REPORT_LINE)  # pod 0's: not filed here
    assert list(state.engine_memory) == [3]
    assert state.engine_memory[3].consumed_bytes == 16 * GIB
    assert state.unparsed_lines == {"worker_prefix": 1}


def test_the_observer_names_the_failed_worker_by_its_global_rank() -> None:
    obs = Observer(None, ranks_on(POD1))
    obs.on_line("(Worker_PP1_TP5 pid=77) ERROR RuntimeError: CUDA error: out of memory")
    assert obs.cause_rank == 13
    # the same failure with figures, repeated by another process: it keeps the rank it had
    obs.on_line("RuntimeError: Worker failed with error '" + OOM.format(gpu=5) + "'")
    assert isinstance(obs.cause, CudaOom) and obs.cause.requested_bytes == 2 * GIB
    assert obs.cause_rank == 13
    other = Observer(None, ranks_on(POD1))
    other.on_line("(Worker_PP1_TP5 pid=77) ERROR RuntimeError: CUDA error: out of memory")
    other.on_line("RuntimeError: Worker failed with error '" + OOM.format(gpu=2) + "'")  # another device
    assert other.cause_rank is None


# -- the termination message -------------------------------------------------------------------


def test_the_termination_message_names_the_global_rank_and_where_it_sits() -> None:
    group = place(POD1)
    oom = CudaOom(text="x", gpu_index=3, requested_bytes=2 * GIB, free_bytes=GIB, total_bytes=80 * GIB)
    m = termination_message(1, oom, None, 8, place=group, cause_rank=11)
    assert (m.reason, m.rank, m.gpu_index) == (CUDA_OOM, 11, 3)
    assert (m.node_rank, m.nnodes, m.local_rank, m.stage, m.tp_rank) == (1, 2, 3, 1, 3)
    assert parse_termination_message(m.to_json()) == m
    # the rank unknown (the leader repeating another pod's error): no rank, still the place
    m = termination_message(1, oom, None, 8, place=place("-tp 8 -pp 2 --nnodes 2"), cause_rank=None)
    assert (m.rank, m.gpu_index, m.node_rank, m.nnodes, m.local_rank, m.stage) == (None, 3, 0, 2, None, None)
    # any reason says where the pod sits
    m = termination_message(2, None, None, 8, place=group)
    assert (m.reason, m.node_rank, m.nnodes, m.rank) == (ENGINE_ERROR, 1, 2, None)


def test_one_node_termination_message_is_unchanged() -> None:
    oom = CudaOom(text="x", gpu_index=3)
    old = termination_message(1, oom, None, 8)
    assert termination_message(1, oom, None, 8, place=SINGLE_NODE, cause_rank=7) == old
    assert (old.rank, old.node_rank, old.nnodes, old.local_rank, old.stage, old.tp_rank) == (
        3,
        None,
        None,
        None,
        None,
        None,
    )


def test_a_long_detail_still_fits_with_the_group_fields() -> None:
    m = TerminationMessage(
        CUDA_OOM, 1, rank=11, node_rank=1, nnodes=2, local_rank=3, stage=1, tp_rank=3, detail="q" * 5000
    )
    text = m.to_json()
    assert len(text.encode()) <= MAX_TERMINATION_BYTES
    assert parse_termination_message(text).stage == 1


def test_an_older_termination_message_still_parses() -> None:
    doc = {"reason": CUDA_OOM, "exit_code": 1, "rank": 3, "gpu_index": 3, "version": 1}
    m = parse_termination_message(json.dumps(doc))
    assert (m.rank, m.node_rank, m.nnodes, m.stage) == (3, None, None, None)


@pytest.mark.parametrize(
    "bad",
    [
        {"node_rank": 1},  # without nnodes
        {"nnodes": 2},  # without node_rank
        {"node_rank": 2, "nnodes": 2},
        {"node_rank": 0, "nnodes": 0},
        {"node_rank": -1, "nnodes": 2},
        {"node_rank": 0, "nnodes": 2, "stage": -1},
        {"node_rank": 0, "nnodes": 2, "tp_rank": "3"},
        {"node_rank": 0, "nnodes": 2, "local_rank": True},
        {"node_rank": 1, "nnodes": 2, "local_rank": 3},  # a local rank without a rank
        {"node_rank": 1, "nnodes": 2, "rank": 2, "local_rank": 3},
    ],
)
def test_bad_group_fields_are_not_a_termination_message(bad: dict[str, Any]) -> None:
    doc = {"reason": CUDA_OOM, "exit_code": 1, "version": 1, **bad}
    with pytest.raises(TerminationError):
        parse_termination_message(json.dumps(doc))
