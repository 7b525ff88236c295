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

In a multi-node group (vLLM's `--nnodes`, `wire.group.GroupPlace`) the labels are the worker's
indices in the whole engine, so the rank they name is the GLOBAL one, and a `cuda:N` (or
PyTorch's "GPU N") is this pod's local device N, global rank node_rank × ranks-per-pod + N.
There only a worker's own (prefixed) lines are attributed: the leader's engine core repeats a
remote worker's error ("Worker failed with error '… GPU 1 …'", in its own log lines and again
unprefixed in the traceback its process prints), and that device index is another pod's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from rankguard_agent.wire.group import GROUP_FLAGS, SINGLE_NODE, GroupPlace, flag_values, local_gpu_rank

_WORKER = re.compile(r"\((Worker(?:_[A-Z]+\d+)*) pid=\d+\)")
_LABEL = re.compile(r"_([A-Z]+)(\d+)")
_ENGINE_CORE = re.compile(r"\(EngineCore(?:_DP\d+)? pid=\d+\)")
_CUDA_DEVICE = re.compile(r"\bcuda:(\d+)\b")

# The parallel sizes' `vllm serve` spellings (wire/group's table; the last one wins).
_SIZE_FLAGS = {flag: dest for flag, dest in GROUP_FLAGS.items() if dest in ("tp", "pp", "pcp", "dp")}
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
    for key, value in flag_values(argv, _SIZE_FLAGS):
        if value.isascii() and value.isdigit() and int(value) > 0:
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
    """Maps a line to the rank of the worker that printed it: the pod's rank on one node, the
    GLOBAL rank in a multi-node group (`place`; `place.local_rank(rank)` is then the pod's GPU)."""

    sizes: ParallelSizes
    n_ranks: int  # ranks the agent sees (0: no GPU readings; then the prefix is trusted)
    place: GroupPlace = field(default=SINGLE_NODE)

    def rank_of(self, line: str) -> int | None:
        if self.place.multi_node:
            return self._group_rank(line, None)
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

    def rank_of_oom(self, line: str, gpu_index: int | None) -> int | None:
        """The rank that ran out of memory, from the line that said so and the device index it
        names (PyTorch's "GPU i", vLLM's "cuda:i": the process's local device). On one node that
        index is the rank (what the launcher did before groups); in a group only a worker's own
        line names a rank of this pod: its labels, or before vLLM labels it, its device."""
        if not self.place.multi_node:
            return local_gpu_rank(gpu_index, self.n_ranks)
        return self._group_rank(line, gpu_index)

    def _group_rank(self, line: str, gpu_index: int | None) -> int | None:
        """The global rank of a line on a pod of a multi-node group, or None."""
        place = self.place
        labels = worker_labels(line)
        rank: int | None = None
        if labels:
            sizes = ParallelSizes(tp=place.tp, pp=place.pp, pcp=place.pcp)
            rank = _rank_from_labels(labels, sizes)
        elif labels is not None:
            # "(Worker pid=…)": a worker of this pod before vLLM names it (its start-up check runs
            # then); the device it names is this pod's
            dev = _CUDA_DEVICE.search(line)
            local = int(dev.group(1)) if dev is not None else gpu_index
            rank = None if local is None else place.global_rank(local)
        if rank is None:
            return None
        local = place.local_rank(rank)
        if local is None or (self.n_ranks > 0 and local >= self.n_ranks):
            return None  # not a rank of this pod (or of the GPUs the agent sees)
        return rank
