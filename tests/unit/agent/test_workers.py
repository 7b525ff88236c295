"""Which rank a vLLM worker's log line comes from: its "(Worker_PPa_TPb pid=N)" prefix, the
parallel sizes on the `vllm serve` command line, or a cuda:N device in the line."""

from __future__ import annotations

import pytest

from rankguard_agent.workers import ParallelSizes, WorkerRanks, parallel_sizes, worker_labels

PREFIX = "INFO 12-01 10:00:00 [gpu_worker.py:1045] Free memory on device (78.5/79.19 GiB) on startup."


@pytest.mark.parametrize(
    ("who", "labels"),
    [
        ("(Worker_TP1 pid=77) ", {"TP": 1}),
        ("(Worker_PP1_TP3 pid=77) ", {"PP": 1, "TP": 3}),
        (
            "(Worker_DP0_PP1_PCP1_TP0_DCP0_EP2 pid=5) ",
            {"DP": 0, "PP": 1, "PCP": 1, "TP": 0, "DCP": 0, "EP": 2},
        ),
        ("(Worker pid=77) ", {}),
        ("(EngineCore_DP0 pid=9) ", None),
        ("", None),
    ],
)
def test_worker_labels(who: str, labels: dict[str, int] | None) -> None:
    assert worker_labels(who + PREFIX) == labels


@pytest.mark.parametrize(
    ("argv", "sizes"),
    [
        (["vllm", "serve", "m", "--tensor-parallel-size", "4"], ParallelSizes(tp=4)),
        (["vllm", "serve", "m", "-tp", "2", "-pp=2"], ParallelSizes(tp=2, pp=2)),
        (["vllm", "serve", "m", "--tensor-parallel-size=8", "-tp", "2"], ParallelSizes(tp=2)),  # last wins
        (
            ["vllm", "serve", "m", "--prefill-context-parallel-size", "2", "-dp", "2"],
            ParallelSizes(pcp=2, dp=2),
        ),
        (["vllm", "serve", "m", "-tp", "x"], ParallelSizes()),
        (["vllm", "serve", "m", "-tp"], ParallelSizes()),
    ],
)
def test_parallel_sizes_from_the_command_line(argv: list[str], sizes: ParallelSizes) -> None:
    assert parallel_sizes(argv) == sizes


@pytest.mark.parametrize(
    ("argv", "n_ranks", "who", "rank"),
    [
        ([], 4, "(Worker_TP3 pid=1) ", 3),  # TP alone needs no size
        ([], 4, "(Worker_TP4 pid=1) ", None),  # not one of the pod's ranks
        (["-tp", "2", "-pp", "2"], 4, "(Worker_PP1_TP0 pid=1) ", 2),
        (["-tp", "2", "-pp", "2"], 4, "(Worker_PP1_TP1 pid=1) ", 3),
        ([], 4, "(Worker_PP1_TP1 pid=1) ", None),  # the TP size is needed and unknown
        (["-tp", "1"], 4, "(Worker_PP1_TP1 pid=1) ", None),  # an index outside its group
        (["-tp", "1", "-pp", "2"], 2, "(Worker_PP1_TP0 pid=1) ", 1),  # a TP label of size 1 is harmless
        ([], 2, "(Worker_PP1 pid=1) ", 1),  # PP alone (TP = 1)
        (["-tp", "2", "-pcp", "2"], 8, "(Worker_PP1_PCP1_TP1 pid=1) ", 7),
        (["-tp", "2", "-dp", "2"], 4, "(Worker_DP1_TP0_EP2 pid=1) ", 2),
        ([], 1, "(Worker pid=1) ", 0),
        ([], 1, "(EngineCore_DP0 pid=9) ", 0),  # one GPU: the engine core's own worker
        ([], 2, "(EngineCore_DP0 pid=9) ", None),
        ([], 0, "(Worker_TP1 pid=1) ", 1),  # no GPU readings: trust the prefix
    ],
)
def test_rank_of_a_worker_line(argv: list[str], n_ranks: int, who: str, rank: int | None) -> None:
    ranks = WorkerRanks(parallel_sizes(["vllm", "serve", "m", *argv]), n_ranks)
    assert ranks.rank_of(who + PREFIX) == rank


def test_a_cuda_device_in_the_line_names_the_rank_without_a_prefix() -> None:
    ranks = WorkerRanks(ParallelSizes(), 4)
    assert ranks.rank_of("ValueError: Free memory on device cuda:2 (1.5/79.19 GiB) on startup is less") == 2
    # the prefix wins over a device named in the text
    assert ranks.rank_of("(Worker_TP1 pid=1) moved from cuda:3") == 1
