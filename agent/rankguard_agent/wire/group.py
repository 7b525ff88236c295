"""Where a pod sits in a vLLM multi-node group, and how vLLM numbers the group's ranks: PURE.

vLLM 0.33's native multi-node mode (the mp executor) runs one engine over `--nnodes` pods; pod
`--node-rank` R runs local_world = W / nnodes workers (W = TP × PCP × PP ranks), the i-th on the
pod's i-th visible GPU, and that worker's global rank is R × local_world + i
(vllm/v1/executor/multiproc_executor.py: `global_start_rank = local_world_size ×
node_rank_within_dp`). The ranks are laid out [PP][PCP][TP], TP fastest: tp_rank = global % TP,
pipeline stage = global // (TP × PCP).

`read_group(argv)` reads those facts from the `vllm serve` command line the launcher starts;
a value it cannot trust makes it answer a single node and say why, since a wrong rank is
worse than a local one, and nothing here may stop vLLM from starting. The operator may use
`GroupPlace` to derive a stage or TP rank from a report that does not carry them.

`GroupFields` and `check_pod_ranks` are the checks `report.parse_report` makes of what a report
says about the group, raising `GroupError` with the reason.

Standard library only: this module runs inside the vLLM container and inside the operator.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

MAX_RANKS = 64  # ranks (GPUs) of one pod: the most one /report lists
MAX_NNODES = 64  # pods of one vLLM multi-node group
MAX_GROUP_RANKS = MAX_RANKS * MAX_NNODES  # one past the largest global rank

# `vllm serve` spellings (vllm_snapshots/0.33.0/cli.json). FlexibleArgumentParser turns `_` into
# `-` in a long option's name; argparse takes `--opt=V`, `-o=V`, and a one-letter short option
# joined to its value (`-n2`); the last occurrence wins.
GROUP_FLAGS: Mapping[str, str] = {
    "--nnodes": "nnodes",
    "-n": "nnodes",
    "--node-rank": "node_rank",
    "-r": "node_rank",
    "--tensor-parallel-size": "tp",
    "-tp": "tp",
    "--pipeline-parallel-size": "pp",
    "-pp": "pp",
    "--prefill-context-parallel-size": "pcp",
    "-pcp": "pcp",
    "--data-parallel-size": "dp",
    "-dp": "dp",
}
_DEFAULTS = {"nnodes": 1, "node_rank": 0, "tp": 1, "pp": 1, "pcp": 1, "dp": 1}


def flag_values(argv: Sequence[str], flags: Mapping[str, str]) -> Iterator[tuple[str, str]]:
    """(key, raw value) for each occurrence of one of `flags` in `argv`, in order ("" when the
    value is missing). Stops at a bare `--`, after which argparse reads no option."""
    for i, arg in enumerate(argv):
        if arg == "--":
            return
        if not arg.startswith("-"):
            continue
        name, eq, value = arg.partition("=")
        if name.startswith("--"):
            name = name.replace("_", "-")
        key = flags.get(name)
        if key is not None:
            yield key, value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        elif not eq and len(arg) > 2 and arg[1] != "-" and flags.get(arg[:2]) is not None:
            yield flags[arg[:2]], arg[2:]  # `-n2`: a one-letter short option joined to its value


@dataclass(frozen=True)
class GroupPlace:
    """One pod's place in its vLLM group. `local_world` is the number of ranks vLLM runs on each
    pod (W / nnodes); 0 = unknown, which a single node does not need (its ranks are its GPUs)."""

    nnodes: int = 1
    node_rank: int = 0
    tp: int = 1
    pp: int = 1
    local_world: int = 0
    pcp: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.nnodes <= MAX_NNODES:
            raise ValueError(f"nnodes {self.nnodes} is outside 1..{MAX_NNODES}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is not one of 0..{self.nnodes - 1}")
        if min(self.tp, self.pp, self.pcp) < 1:
            raise ValueError("tensor, pipeline and prefill-context parallel sizes must be positive")
        if self.nnodes > 1:
            if not 1 <= self.local_world <= MAX_RANKS:
                raise ValueError(f"{self.local_world} ranks per pod is outside 1..{MAX_RANKS}")
            if self.local_world * self.nnodes != self.world:
                raise ValueError(
                    f"TP {self.tp} x PCP {self.pcp} x PP {self.pp} = {self.world} ranks do not split "
                    f"into {self.nnodes} pods of {self.local_world}"
                )

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def world(self) -> int:
        """The engine's ranks: TP × PCP × PP."""
        return self.tp * self.pcp * self.pp

    @property
    def first_rank(self) -> int:
        """The global rank of this pod's local rank 0."""
        return self.node_rank * self.local_world

    def global_rank(self, local: int) -> int:
        return self.first_rank + local

    def local_rank(self, global_rank: int) -> int | None:
        """This pod's local rank (GPU index) of a global rank; None when another pod runs it.
        On one node every index is its own (the agent reports every GPU it sees)."""
        if global_rank < 0:
            return None
        if not self.multi_node:
            return global_rank
        local = global_rank - self.first_rank
        return local if 0 <= local < self.local_world else None

    def node_of(self, global_rank: int) -> int:
        """The node rank of the pod that runs a global rank."""
        return global_rank // self.local_world if self.multi_node else 0

    def stage(self, global_rank: int) -> int:
        """The pipeline stage (PP rank) of a global rank."""
        return global_rank // (self.tp * self.pcp)

    def tp_rank(self, global_rank: int) -> int:
        return global_rank % self.tp


SINGLE_NODE = GroupPlace()


def local_gpu_rank(gpu_index: int | None, n_ranks: int) -> int | None:
    """One node: PyTorch's "GPU i" is the engine's local device i, which is rank i of this pod
    (None when the index is not one of the `n_ranks` GPUs the agent sees; 0 = it sees none)."""
    if gpu_index is None or gpu_index < 0:
        return None
    if n_ranks > 0 and gpu_index >= n_ranks:
        return None  # the engine saw other devices than the agent did; do not guess
    return gpu_index


def read_group(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[GroupPlace, str | None]:
    """The group a `vllm serve …` argv starts, and a line for the log when something is off
    (None when nothing is): why it answers a single node, or a disagreement it noticed.

    Defaults are vLLM's: 1 node, node rank 0, TP = PP = PCP = 1. A value that is not a number, a
    node rank outside the group, a world that does not split evenly over the nodes, or data
    parallelism across nodes (whose rank layout this does not map) make it a single node.
    `env["RANKGUARD_NODE_RANK"]` (the operator sets it) is only checked against the argv, which
    is what vLLM itself reads."""
    raw: dict[str, str] = {}
    for key, value in flag_values(argv, GROUP_FLAGS):
        raw[key] = value
    found = dict(_DEFAULTS)
    for key, value in raw.items():
        if not value.isascii() or not value.isdigit():
            if raw.get("nnodes", "1") == "1" and key not in ("nnodes", "node_rank"):
                continue  # one node: a size rankguard cannot read changes nothing here
            return SINGLE_NODE, f"{_spelling(key)} {value!r:.40} is not a number"
        found[key] = int(value)
    nnodes = found["nnodes"]
    if nnodes == 1:
        if found["node_rank"] != 0:
            return SINGLE_NODE, f"--node-rank {found['node_rank']} of a single node"
        return SINGLE_NODE, None
    if not 1 < nnodes <= MAX_NNODES:
        return SINGLE_NODE, f"nnodes {nnodes} is outside 1..{MAX_NNODES}"
    if found["dp"] > 1:
        return SINGLE_NODE, "data parallelism across nodes is not mapped to global ranks"
    world = found["tp"] * found["pcp"] * found["pp"]
    if world % nnodes:
        return SINGLE_NODE, f"{world} ranks do not split evenly over {nnodes} nodes"
    try:
        place = GroupPlace(
            nnodes=nnodes,
            node_rank=found["node_rank"],
            tp=found["tp"],
            pp=found["pp"],
            local_world=world // nnodes,
            pcp=found["pcp"],
        )
    except ValueError as e:
        return SINGLE_NODE, str(e)
    said = (env or {}).get("RANKGUARD_NODE_RANK")
    if said is not None and said != str(place.node_rank):
        return place, f"RANKGUARD_NODE_RANK={said!r:.20} but vLLM runs --node-rank {place.node_rank} (used)"
    return place, None


def _spelling(key: str) -> str:
    return next(flag for flag, k in GROUP_FLAGS.items() if k == key)


class GroupError(ValueError):
    """What a report says about its group does not hold together."""


@dataclass(frozen=True)
class GroupFields:
    """What a /report says of its pod's place in a group (`nnodes`, `node_rank`,
    `local_world_size`, `tp_size`, `pp_size`; None = not said, all None on one node), checked
    against each other when made and against each rank by `check_rank`."""

    nnodes: int | None = None
    node_rank: int | None = None
    local_world: int | None = None
    tp: int | None = None
    pp: int | None = None

    def __post_init__(self) -> None:
        if (self.nnodes is None) != (self.node_rank is None):
            raise GroupError("nnodes and node_rank come together")
        if self.nnodes is not None and self.node_rank is not None and not self.node_rank < self.nnodes:
            raise GroupError(f"node_rank {self.node_rank} is not one of the group's 0..{self.nnodes - 1}")
        world, split = self.world, (self.tp or 1) * (self.pp or 1)
        if world is not None and world % split:
            raise GroupError(f"tp_size x pp_size ({split}) does not divide the group's {world} ranks")

    @property
    def world(self) -> int | None:
        return None if self.nnodes is None or self.local_world is None else self.nnodes * self.local_world

    @property
    def first_rank(self) -> int | None:
        """The global rank of the pod's GPU 0, when the report says where the pod sits."""
        if self.node_rank is None or self.local_world is None:
            return None
        return self.node_rank * self.local_world

    @property
    def rank_limit(self) -> int:
        """One past the largest global rank the report may name."""
        if self.nnodes is None:
            return MAX_RANKS  # one node: its ranks are its GPUs
        return self.world or MAX_GROUP_RANKS

    def check_rank(
        self, rank: int, local: int | None, stage: int | None = None, tp_rank: int | None = None
    ) -> None:
        """A rank's global number against its local one, stage and TP rank (each None = not said)."""
        first = self.first_rank
        if local is not None and first is not None:
            if rank != first + local:
                raise GroupError(
                    f"rank {rank} is not node_rank {self.node_rank} x local_world_size "
                    f"{self.local_world} + local_rank {local}"
                )
        elif local is not None and rank < local:
            raise GroupError(f"rank {rank} is below its local_rank {local}")
        if tp_rank is not None and self.tp is not None and tp_rank != rank % self.tp:
            raise GroupError(f"tp_rank {tp_rank} is not rank {rank} mod tp_size {self.tp}")
        world, pp = self.world, self.pp
        if stage is not None and pp is not None and world is not None and stage != rank // (world // pp):
            raise GroupError(f"stage {stage} is not rank {rank}'s with pp_size {pp}")


def check_pod_ranks(ranks: Sequence[tuple[int, int | None]], first: int | None = None) -> None:
    """One pod's (rank, local_rank) pairs: its GPUs 0..N-1, each once. Every rank says its local
    rank, and is it plus the pod's first rank; or none does, and the ranks are `first`..`first`+N-1
    (`first`: node_rank × local_world_size when the report says both, else 0: one node)."""
    if all(local is None for _, local in ranks):
        start = first or 0
        if sorted(rank for rank, _ in ranks) != list(range(start, start + len(ranks))):
            raise GroupError(
                "ranks must be 0..N-1, each once" if not start else f"ranks must be {start}..{start}+N-1"
            )
        return
    locals_ = [local for _, local in ranks if local is not None]
    if len(locals_) != len(ranks):
        raise GroupError("local_rank is said on some ranks and not on others")
    if sorted(locals_) != list(range(len(ranks))):
        raise GroupError("local ranks must be 0..N-1, each once")
    if len({rank - (local or 0) for rank, local in ranks}) > 1:
        raise GroupError("rank - local_rank must be the same on every rank of a pod")
