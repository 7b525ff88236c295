"""Which rank a vLLM worker's log line comes from: PURE functions.

vLLM's multiprocessing workers prefix every line with their process name, e.g.
"(Worker_PP1_TP0 pid=77) INFO ...". The name lists the worker's index in each parallel group
whose size is above 1, outermost first: DP, PP, PCP, TP, then DCP and EP (vllm/v1/executor/
multiproc_executor.py, `setup_proc_title_and_log_prefix`); a bare "Worker" is the only one.

vLLM lays the ranks of one engine out as [DP][PP][PCP][TP] and each worker uses the local
device `cuda:rank`, so the pod's rank is ((dp·PP + pp)·PCP + pcp)·TP + tp. DCP splits the TP
group and EP is derived from DP×TP, so neither adds a dimension. A label that is absent means
that group has size 1; the size of a group that *is* labelled is needed only when an outer
label multiplies it, and is read from the `vllm serve` command line (which overrides a
--config file in vLLM). When it cannot be known (set only in a --config file, say), the line
is not attributed: a wrong rank is worse than none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_WORKER = re.compile(r"\((Worker(?:_[A-Z]+\d+)*) pid=\d+\)")
_LABEL = re.compile(r"_([A-Z]+)(\d+)")
_ENGINE_CORE = re.compile(r"\(EngineCore(?:_DP\d+)? pid=\d+\)")
_CUDA_DEVICE = re.compile(r"\bcuda:(\d+)\b")

# `vllm serve` spellings (vllm_snapshots/*/cli.json); argparse lets the last one win.
_SIZE_FLAGS = {
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
    "--prefill-context-parallel-size": "pcp",
    "-pcp": "pcp",
    "--data-parallel-size": "dp",
    "-dp": "dp",
}
# Outermost first; these are the groups that multiply the rank.
_DIMENSIONS = ("DP", "PP", "PCP", "TP")


@dataclass(frozen=True)
class ParallelSizes:
    """Group sizes given on the command line; None = not given there."""

    tp: int | None = None
    pp: int | None = None
    pcp: int | None = None
    dp: int | None = None

    def of(self, label: str) -> int | None:
        size: int | None = getattr(self, label.lower())
        return size


def parallel_sizes(argv: Sequence[str]) -> ParallelSizes:
    """The parallel sizes a `vllm serve ...` argv sets (unreadable values are ignored)."""
    found: dict[str, int] = {}
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        key = _SIZE_FLAGS.get(flag)
        if key is None:
            continue
        if not eq:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if value.isdigit() and int(value) > 0:
            found[key] = int(value)
    return ParallelSizes(**found)


def worker_labels(line: str) -> dict[str, int] | None:
    """{"PP": 1, "TP": 0} for a "(Worker_PP1_TP0 pid=77)" line, {} for "(Worker pid=77)",
    None when the line has no worker prefix."""
    m = _WORKER.search(line)
    if m is None:
        return None
    return {k: int(v) for k, v in _LABEL.findall(m.group(1))}


def _rank_from_labels(labels: dict[str, int], sizes: ParallelSizes) -> int | None:
    present = [d for d in _DIMENSIONS if d in labels]
    rank = 0
    for i, dim in enumerate(present):
        index = labels[dim]
        if i == 0:
            rank = index  # the outermost group multiplies nothing: its size does not matter
            continue
        # The command line is authoritative (vLLM lets it override a --config file); without it
        # the size is unknown, and a guess could name the wrong rank.
        size = sizes.of(dim)
        if size is None or index >= size:
            return None
        rank = rank * size + index
    return rank


@dataclass(frozen=True)
class WorkerRanks:
    """Maps a line to the pod's rank of the worker that printed it."""

    sizes: ParallelSizes
    n_ranks: int  # ranks the agent sees (0: no GPU readings; then the prefix is trusted)

    def rank_of(self, line: str) -> int | None:
        labels = worker_labels(line)
        rank: int | None
        if labels is not None:
            rank = _rank_from_labels(labels, self.sizes)
        elif (dev := _CUDA_DEVICE.search(line)) is not None:
            rank = int(dev.group(1))
        elif self.n_ranks == 1 and (_ENGINE_CORE.search(line) or not line.startswith("(")):
            rank = 0  # one GPU: vLLM runs its only worker inside the engine core, unprefixed
        else:
            rank = None
        if rank is None or (self.n_ranks > 0 and rank >= self.n_ranks):
            return None
        return rank
