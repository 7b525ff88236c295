"""vLLM 0.33's native multi-node serving (`--nnodes N`, the mp backend) as the fake vLLM plays it:
the flags, a node's place in its group, and what each node prints when the group fails.
The rendezvous that connects the nodes is rendezvous.py's.

What vLLM 0.33 does (read from the package; every vLLM and torch string comes from the recorded
snapshot, `vllm_snapshot.message`):

* Flags (vllm/engine/arg_utils.py, vllm/config/parallel.py). `--nnodes N --node-rank r
  --master-addr A --master-port P`; the world (DP × PP × TP × PCP) is split evenly over the
  nodes, local_world_size G = W / N, and node r's local rank i is global rank r × G + i
  (multiproc_executor.py), ranks laid out TP fastest, PP slowest. Refused in vLLM's words
  (`check_flags`): a `--data-parallel-backend` other than mp, a world the nodes do not divide,
  a node rank outside 0..N−1, a `--distributed-executor-backend` other than mp, uni or
  external_launcher.
* The leader (node rank 0) runs the API server and the engine core, whose executor logs "DP
  group leader: …" and starts the node's G workers; worker 0 hosts torch.distributed's TCPStore
  on P and waits for all W ranks. It alone serves HTTP. A headless node (`--headless`, rank
  ≥ 1) runs neither: its main process logs "Launching vLLM (v…) headless multiproc executor,
  with head node address A:P …" without a process prefix, and its workers connect to A:P.
* Lines. Workers are named by their global ranks (Worker_PP1_TP3). vLLM's `info_once` lines
  (scope "local", vllm/logger.py) come once per node, from its local rank 0: "Starting to load
  model", "Model loading took", "Available KV cache memory", "Graph capturing finished"; the
  memory report, the CUDA graph pool and the kv_cache_memory_bytes lines come from every worker.
  The leader's engine core plans the KV cache from every rank of every node (the minimum of
  their blocks) and logs the KV cache size and maximum concurrency once.
* Timeouts. `--distributed-timeout-seconds` (unset: torch's NCCL default, 600 s, engine.json)
  bounds the rendezvous and every collective. What ends them, as printed here: the leader's
  TCPStore waiting for ranks, torch's DistStoreError "Timed out after T seconds waiting for
  clients. j/W clients joined."; a worker that cannot reach A:P, torch's DistNetworkError "The
  client socket has timed out after Ts while trying to connect to (A, P)."; a node lost after the
  group formed: on the leader, vLLM's executor "RPC call to <method> timed out." (TimeoutError,
  multiproc_executor.py), the closest recorded message: a real stall may instead end in NCCL's
  watchdog, whose "Watchdog caught collective operation timeout: WorkNCCL(…)" torch assembles
  from pieces (libtorch_cuda.so) no template records; on a headless node, whose real workers
  would keep waiting, vLLM's own wait message ("No available shared memory broadcast block found
  in T seconds …", shm_broadcast.py), then the sandbox ends it (exit 1, a `rankguard-sim:` line).
  A restarted headless node that comes back after the group formed is never let in: vLLM's
  group forms once, so it waits out its timeout and fails as one that cannot connect.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from rankguard_sim.fake_vllm.console import Console, failure_lines, traceback_lines, worker_name
from rankguard_sim.fake_vllm.sandbox import SIM_LINE
from rankguard_sim.physics.engine_failures import EngineFailure
from rankguard_sim.physics.engine_memory import EngineMemoryModel
from rankguard_sim.physics.scenario_data import Scenario
from rankguard_sim.vllm_snapshot import distributed_timeout_seconds, message, where

DISTRIBUTED_TIMEOUT_ENV = "RANKGUARD_SIM_DISTRIBUTED_TIMEOUT_S"
HOST_IP_ENV = "VLLM_HOST_IP"
SIM = f"{SIM_LINE} rendezvous:"
_WORKER_ERROR = "multiproc_executor.py:1057"  # `logger.exception("WorkerProc failed to start.")`
_WORKER_HIT = "multiproc_executor.py:1189"  # `logger.exception("WorkerProc hit an exception.")`
_INIT_DEVICE = [
    ("v1/worker/gpu_worker.py", 504, "init_device", "init_worker_distributed_environment("),
    (
        "distributed/parallel_state.py",
        1976,
        "init_distributed_environment",
        "torch.distributed.init_process_group(",
    ),
]
_RUN_HEADLESS = [
    (
        "entrypoints/cli/serve.py",
        231,
        "run_headless",
        "executor = MultiprocExecutor(vllm_config, monitor_workers=False)",
    ),
    (
        "v1/executor/multiproc_executor.py",
        238,
        "_init_executor",
        "self.workers = WorkerProc.wait_for_ready(unready_workers)",
    ),
    ("v1/executor/multiproc_executor.py", 916, "wait_for_ready", "raise e from None"),
]
_RPC = (
    "v1/executor/multiproc_executor.py",
    509,
    "get_response",
    'raise TimeoutError(f"RPC call to {method} timed out.") from e',
)


# ---------------------------------------------------------------------------------------------
# Flags


def check_flags(args: argparse.Namespace) -> str | None:
    """vLLM's refusal of these multi-node flags (the ValueError's text), None when it takes them;
    then the sandbox's own, for what it does not simulate."""
    return vllm_refusal(args) or sandbox_refusal(args)


def vllm_refusal(args: argparse.Namespace) -> str | None:
    """vLLM's own refusal of these multi-node flags (the ValueError's text), None when it takes them."""
    n = int(args.nnodes)
    if n <= 1:
        return None
    if args.data_parallel_backend != "mp":
        return message("nnodes_backend", n, args.data_parallel_backend)
    world = args.data_parallel_size * args.pipeline_parallel_size * args.tensor_parallel_size
    world *= args.prefill_context_parallel_size
    if world % n:
        return message("nnodes_world_size", n, world)
    if not 0 <= args.node_rank < n:
        return message("node_rank_range", n - 1, args.node_rank)
    if args.distributed_executor_backend not in (None, "mp", "uni", "external_launcher"):
        return message("nnodes_executor_backend")
    return None


def sandbox_refusal(args: argparse.Namespace) -> str | None:
    """What the sandbox does not simulate of multi-node flags vLLM takes (not vLLM's words)."""
    if int(args.nnodes) <= 1:
        return None
    if args.distributed_executor_backend not in (None, "mp"):
        backend = args.distributed_executor_backend
        return f"the sandbox simulates --nnodes with the mp executor only, not {backend}"
    if args.data_parallel_size != 1 or args.prefill_context_parallel_size != 1:
        return "the sandbox simulates --nnodes for TP × PP only (data and context parallel size 1)"
    if bool(args.headless) != (args.node_rank > 0):
        return "the sandbox simulates --nnodes as one leader (--node-rank 0) and headless nodes (--headless)"
    return None


@dataclass(frozen=True)
class Topology:
    """This node's place: its rank, its ranks, where the leader is and how long a wait lasts."""

    nnodes: int
    node_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    timeout_s: float  # wall-clock seconds a wait on the group lasts
    timeout_shown: int  # the seconds vLLM and torch print

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.local_world_size

    @property
    def ranks(self) -> range:
        return range(self.node_rank * self.local_world_size, (self.node_rank + 1) * self.local_world_size)


def topology(args: argparse.Namespace, env: Mapping[str, str], time_scale: float) -> Topology | None:
    """The node's topology for `--nnodes N > 1` (flags already checked), None for one node."""
    n = int(args.nnodes)
    if n <= 1:
        return None
    override = env.get(DISTRIBUTED_TIMEOUT_ENV, "").strip()
    if override:
        timeout = float(override)
        if not timeout > 0:
            raise ValueError(f"{DISTRIBUTED_TIMEOUT_ENV} must be a positive number, got {override!r}")
        wall, shown = timeout, round(timeout)
    else:
        flag = args.distributed_timeout_seconds
        shown = distributed_timeout_seconds() if flag is None else int(flag)
        wall = shown / time_scale
    return Topology(
        nnodes=n,
        node_rank=int(args.node_rank),
        local_world_size=args.tensor_parallel_size * args.pipeline_parallel_size // n,
        master_addr=str(args.master_addr),
        master_port=int(args.master_port),
        timeout_s=wall,
        timeout_shown=shown,
    )


# ---------------------------------------------------------------------------------------------
# Failures


class GroupFailure(EngineFailure):
    """A wait on the group ran out: `final` is the exception line the node ends with."""

    reason = "DistributedTimeout"

    def __init__(self, phase: str, final: str) -> None:
        super().__init__(None, phase)
        self.final = final

    def message(self) -> str:
        return self.final


def rendezvous_timeout(t: Topology, joined: int) -> GroupFailure:
    text = message("store_clients_timeout", t.timeout_shown, joined, t.world_size)
    return GroupFailure("rendezvous", f"torch.distributed.DistStoreError: {text}")


def connect_timeout(t: Topology) -> GroupFailure:
    text = message("client_connect_timeout", f"{t.timeout_shown}s", t.master_addr, t.master_port)
    return GroupFailure("rendezvous", f"torch.distributed.DistNetworkError: {text}")


def rpc_timeout(method: str) -> GroupFailure:
    return GroupFailure(method, f"TimeoutError: {message('rpc_timed_out', method)}")


def lost(t: Topology) -> GroupFailure:
    return GroupFailure(
        "lost",
        f"{SIM} node rank {t.node_rank} lost its group (the leader at {t.master_addr}:{t.master_port} "
        "or another node): vLLM's workers would wait on, the sandbox ends them",
    )


# ---------------------------------------------------------------------------------------------
# What a node prints when it fails


class Node(Protocol):
    """What the group needs of the fake vLLM (main.FakeVllm)."""

    console: Console
    engine: EngineMemoryModel
    scenario: Scenario
    stop: asyncio.Event

    async def pause(self, seconds: float, *, scaled: bool = True) -> None: ...

    def workers(self, once: bool = False) -> list[tuple[int, str]]: ...


def report_failure(node: Node, topo: Topology, failure: EngineFailure, at_startup: bool) -> bool:
    """Print a failure the way this node's vLLM does; False leaves it to the fake's own report
    (the leader's failures on its own ranks)."""
    c = node.console
    if topo.leader:
        if failure.phase == "kv-cache":  # the engine core's own check, over every node's ranks
            c.engine_failed_to_start(failure_lines(failure))
            return True
        if not isinstance(failure, GroupFailure):
            return False
        if failure.phase == "rendezvous":  # worker 0's TCPStore: still named plainly "Worker"
            c.error_lines(
                "Worker",
                _WORKER_ERROR,
                ["WorkerProc failed to start.", *traceback_lines(_INIT_DEVICE, failure.final)],
            )
            c.engine_failed_to_start([failure.final])
        elif at_startup:
            c.engine_failed_to_start(traceback_lines([_RPC], failure.final))
        else:
            c.engine_died(failure.final)
        return True
    if isinstance(failure, GroupFailure) and failure.phase == "rendezvous":
        for _ in node.workers():  # every worker's TCPStore client (not named yet)
            c.error_lines(
                "Worker",
                _WORKER_ERROR,
                ["WorkerProc failed to start.", *traceback_lines(_INIT_DEVICE, failure.final)],
            )
        c.plain(
            "\n".join(traceback_lines(_RUN_HEADLESS, f"Exception: {message('worker_init_failed')}")),
            error=True,
        )
    elif isinstance(failure, GroupFailure):  # its workers wait on the leader's next message
        for _, who in node.workers(once=True):
            c.info(who, where("broadcast_wait"), message("broadcast_wait", topo.timeout_shown))
        c.plain(failure.final, error=True)
    elif at_startup:
        who = "Worker" if failure.rank is None else worker_name(node.scenario, failure.rank)
        c.error_lines(who, _WORKER_ERROR, ["WorkerProc failed to start.", *failure_lines(failure)])
        c.plain(
            "\n".join(traceback_lines(_RUN_HEADLESS, f"Exception: {message('worker_init_failed')}")),
            error=True,
        )
    else:
        who = "Worker" if failure.rank is None else worker_name(node.scenario, failure.rank)
        c.error_lines(who, _WORKER_HIT, ["WorkerProc hit an exception.", *failure_lines(failure)])
    return True
