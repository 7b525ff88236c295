"""The sandbox's rendezvous for a multi-node fake vLLM (multinode.py): how the nodes of one group
meet, exchange what vLLM's collectives carry and notice a node gone.

The sandbox's protocol: one TCP connection from each headless node to the leader at
`master_addr:master_port` (the leader listens on its pod's address: VLLM_HOST_IP, else
RANKGUARD_SIM_POD_IP, else 0.0.0.0; a headless node resolves master_addr through the sandbox's
cluster DNS, kube/dns.py, or takes it as an IP literal, and retries until its timeout), one JSON
object per line:

    headless → leader   {"op": "join", "node_rank": r, "nnodes": N, "world_size": W, "pid": …,
                         "vmm": its GPUs' drivers support virtual memory management}
    leader → headless   {"op": "welcome"} | {"op": "refuse", "why": …} (then it closes)
    leader → all        {"op": "formed", "vmm": every node's}   every node joined: start-up begins
    headless → leader   {"op": "kv", "available": [G ints], "requested": [G ints]}
    leader → all        {"op": "plan", …KVPlan's fields}    the engine's plan, every rank's
    headless → leader   {"op": "measured", "blocks": [G ints]}  vLLM 0.34: after warm-up
    leader → all        {"op": "settled", …KVPlan's fields}     the minimum over every rank
    headless → leader   {"op": "ready"}                     warmed up: the leader serves HTTP
    leader → all        {"op": "step", "running": n}        one decode step's batch
    headless → leader   {"op": "stepped"}
    leader → all        {"op": "lost", "node_rank": r}      a node's connection dropped

A wait on the group ends at the distributed timeout after it began: the leader's for every node
to join, for their KV figures, their readiness and each step's answers; a headless node's for
the formed group and the plan, or, once it serves, from the moment its leader (or another node)
is lost. A dropped connection does not end a wait early: the peers stall until the timeout, as
NCCL's do. RANKGUARD_SIM_DISTRIBUTED_TIMEOUT_S (wall-clock seconds) overrides the flag; the
flag's seconds (or torch's default) are scaled by RANKGUARD_SIM_TIME_SCALE like vLLM's phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankguard_sim.fake_vllm.console import Console
from rankguard_sim.fake_vllm.multinode import (
    HOST_IP_ENV,
    SIM,
    GroupFailure,
    Node,
    Topology,
    connect_timeout,
    lost,
    rendezvous_timeout,
    report_failure,
    rpc_timeout,
)
from rankguard_sim.fake_vllm.sandbox import bind_address
from rankguard_sim.kube.dns import resolve
from rankguard_sim.physics.engine_failures import EngineFailure
from rankguard_sim.physics.engine_measured import MeasuredEngineModel
from rankguard_sim.physics.engine_memory import KVPlan
from rankguard_sim.vllm_snapshot import message, version, where

_LINE_LIMIT = 1 << 20


class _Timeout(Exception):
    """A wait's deadline passed."""


# ---------------------------------------------------------------------------------------------
# The group, as a node of it sees it


def _plan(doc: Mapping[str, Any]) -> KVPlan:
    """The leader's plan as a headless node receives it."""
    return KVPlan(
        available=tuple(int(x) for x in doc["available"]),
        requested=tuple(int(x) for x in doc["requested"]),
        num_gpu_blocks=int(doc["num_gpu_blocks"]),
        kv_bytes=tuple(int(x) for x in doc["kv_bytes"]),
        block_size=int(doc["block_size"]),
        pinned=bool(doc["pinned"]),
        max_model_len=int(doc["max_model_len"]),
        null_blocks=int(doc["null_blocks"]),
    )


@dataclass
class _Peer:
    node_rank: int
    writer: asyncio.StreamWriter
    vmm: bool = True
    inbox: asyncio.Queue[dict[str, Any] | None] = dataclasses.field(default_factory=asyncio.Queue)


def _send(writer: asyncio.StreamWriter, doc: Mapping[str, Any]) -> None:
    with contextlib.suppress(OSError, RuntimeError):  # a dropped peer is found by its reader
        writer.write((json.dumps(doc) + "\n").encode())


async def _read(reader: asyncio.StreamReader, inbox: asyncio.Queue[dict[str, Any] | None]) -> None:
    """Every line from a peer into its inbox, then None once the connection drops."""
    try:
        while line := await reader.readline():
            with contextlib.suppress(ValueError):
                doc = json.loads(line)
                if isinstance(doc, dict):
                    inbox.put_nowait(doc)
    except (OSError, ValueError, asyncio.IncompleteReadError):
        pass
    inbox.put_nowait(None)


class Group:
    """One node's end of the rendezvous; FakeVllm calls it at each step of its life."""

    def __init__(self, topo: Topology, env: Mapping[str, str], console: Console, peak_hold_s: float) -> None:
        self.topo = topo
        self.env = env
        self.console = console
        self.peak_hold_s = peak_hold_s
        self.peers: dict[int, _Peer] = {}  # the leader's: node rank -> connection
        self.formed = False
        self.vmm = True  # this node's GPUs support VMM (the fake sets it before `form`)
        self.world_vmm = True  # every node's: vLLM turns its extensible KV cache off otherwise
        self.refused: set[object] = set()  # node ranks refused (said once each)
        self.lost_at: float | None = None  # a headless node's: when its group lost a node
        self.inbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()  # a headless node's
        self.writer: asyncio.StreamWriter | None = None
        self._joined = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def leader(self) -> bool:
        return self.topo.leader

    @property
    def ranks(self) -> range:
        return self.topo.ranks

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.topo.timeout_s

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _get(
        self, node: Node, inbox: asyncio.Queue[dict[str, Any] | None], deadline: float | None
    ) -> Any:
        """The next message (None: the connection dropped); _Timeout at the deadline; SIGTERM
        raises the fake's own stop (through its pause)."""
        loop = asyncio.get_running_loop()
        getter = asyncio.ensure_future(inbox.get())
        stopper = asyncio.ensure_future(node.stop.wait())
        timeout = None if deadline is None else max(0.0, deadline - loop.time())
        try:
            done, _ = await asyncio.wait(
                {getter, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (getter, stopper):
                if not task.done():
                    task.cancel()
        if node.stop.is_set():
            await node.pause(0, scaled=False)  # raises the fake's _Stopped
        if getter in done:
            return getter.result()
        raise _Timeout

    async def _expect(
        self, node: Node, inbox: asyncio.Queue[dict[str, Any] | None], op: str, deadline: float
    ) -> dict[str, Any]:
        """The next `op` message; a dropped connection stalls until the deadline (_Timeout)."""
        while True:
            doc = await self._get(node, inbox, deadline)
            if doc is None:
                await node.pause(max(0.0, deadline - asyncio.get_running_loop().time()), scaled=False)
                raise _Timeout
            if doc.get("op") == op:
                return dict(doc)

    # -- forming the group ----------------------------------------------------------------------

    async def form(self, node: Node) -> None:
        """Vllm's rendezvous: the leader waits for every node, a headless node joins it."""
        t, c = self.topo, node.console
        if not self.leader:
            address = f"{t.master_addr}:{t.master_port}"
            c.bare("INFO", where("headless_launch"), message("headless_launch", version(), address))
            await self._join(node)
            return
        host = self.env.get(HOST_IP_ENV) or bind_address(None, self.env)  # vLLM's get_ip()
        c.info(
            "EngineCore_DP0",
            where("dp_group_leader"),
            message("dp_group_leader", 0, 0, t.master_addr, host, t.world_size, t.local_world_size),
        )
        listen = self.env.get(HOST_IP_ENV) or bind_address(None, self.env)
        try:
            self._server = await asyncio.start_server(self._accept, listen, t.master_port, limit=_LINE_LIMIT)
        except OSError as e:  # worker 0's TCPStore cannot listen (the port is taken)
            raise GroupFailure("rendezvous", f"OSError: [Errno {e.errno}] {e.strerror}") from None
        c.plain(f"{SIM} leader listening on {listen}:{t.master_port}, waiting for {t.nnodes - 1} node(s)")
        deadline = self._deadline()
        while len(self.peers) < t.nnodes - 1:
            self._joined.clear()
            left = deadline - asyncio.get_running_loop().time()
            stopper = asyncio.ensure_future(node.stop.wait())
            joined = asyncio.ensure_future(self._joined.wait())
            await asyncio.wait({stopper, joined}, timeout=max(0.0, left), return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            joined.cancel()
            await node.pause(0, scaled=False)  # SIGTERM ends the wait
            if len(self.peers) < t.nnodes - 1 and asyncio.get_running_loop().time() >= deadline:
                raise rendezvous_timeout(t, (1 + len(self.peers)) * t.local_world_size)
        self.formed = True
        self.world_vmm = self.vmm and all(p.vmm for p in self.peers.values())
        for peer in self.peers.values():
            _send(peer.writer, {"op": "formed", "vmm": self.world_vmm})
        c.plain(f"{SIM} group formed: {t.nnodes} nodes, {t.world_size} ranks")

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        t = self.topo
        try:
            doc = json.loads(await asyncio.wait_for(reader.readline(), 10))
        except (OSError, ValueError, asyncio.TimeoutError):
            writer.close()
            return
        rank = doc.get("node_rank") if isinstance(doc, dict) else None
        why = None
        if not isinstance(doc, dict) or doc.get("op") != "join" or not isinstance(rank, int):
            why = "not a join"
        elif self.formed:
            why = "the group has formed (vLLM's rendezvous happens once)"
        elif not 1 <= rank < t.nnodes:
            why = f"node rank {rank} is not one of 1..{t.nnodes - 1}"
        elif rank in self.peers:
            why = f"node rank {rank} has joined already"
        elif (doc.get("nnodes"), doc.get("world_size")) != (t.nnodes, t.world_size):
            why = f"another group ({doc.get('nnodes')} nodes, world size {doc.get('world_size')})"
        if why is not None:
            _send(writer, {"op": "refuse", "why": why})
            with contextlib.suppress(OSError):
                await writer.drain()
            writer.close()
            if rank not in self.refused:  # once per node rank: a refused node retries until its timeout
                self.refused.add(rank)
                peer = writer.get_extra_info("peername")
                self.console.plain(f"{SIM} refused node rank {rank} from {peer[0] if peer else '?'}: {why}")
            return
        assert isinstance(rank, int)
        peer = _Peer(rank, writer, vmm=doc.get("vmm") is not False)
        self.peers[rank] = peer
        _send(writer, {"op": "welcome"})
        self._spawn(self._follow(peer, reader))
        self._joined.set()

    async def _follow(self, peer: _Peer, reader: asyncio.StreamReader) -> None:
        """A headless node's messages into its inbox; its drop is told to the other nodes."""
        await _read(reader, peer.inbox)
        self.console.plain(f"{SIM} lost node rank {peer.node_rank} (its connection dropped)")
        for other in self.peers.values():
            if other is not peer:
                _send(other.writer, {"op": "lost", "node_rank": peer.node_rank})

    async def _join(self, node: Node) -> None:
        """Connect to the leader until let in and the group formed, or the timeout ran out."""
        t, loop = self.topo, asyncio.get_running_loop()
        deadline = self._deadline()
        told = False
        while True:
            await node.pause(0, scaled=False)
            if loop.time() >= deadline:
                raise connect_timeout(t)
            answer = await self._try_join(min(1.0, max(0.01, deadline - loop.time())))
            if answer is not None and answer.get("op") == "welcome":
                break
            if answer is not None and not told:
                told = True
                node.console.plain(
                    f"{SIM} the leader at {t.master_addr}:{t.master_port} refused node rank "
                    f"{t.node_rank}: {answer.get('why')}"
                )
            await node.pause(0.1, scaled=False)
        node.console.plain(
            f"{SIM} joined the leader at {t.master_addr}:{t.master_port} as node rank {t.node_rank}"
        )
        formed = await self._headless_wait(node, "formed", deadline)
        self.world_vmm = formed.get("vmm") is not False

    async def _try_join(self, timeout: float) -> dict[str, Any] | None:
        """One attempt: the leader's answer, or None when it cannot be reached (yet)."""
        t = self.topo
        address = resolve(t.master_addr, self.env)
        if address is None:
            return None
        own = bind_address(None, self.env)  # from the pod's IP, as from its network namespace
        local = None if own == "0.0.0.0" else (own, 0)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(address, t.master_port, limit=_LINE_LIMIT, local_addr=local), timeout
            )
        except (OSError, asyncio.TimeoutError):
            return None
        join = {
            "op": "join",
            "node_rank": t.node_rank,
            "nnodes": t.nnodes,
            "world_size": t.world_size,
            "pid": os.getpid(),
            "vmm": self.vmm,
        }
        _send(writer, join)
        try:
            answer = json.loads(await asyncio.wait_for(reader.readline(), timeout + 5))
        except (OSError, ValueError, asyncio.TimeoutError):
            writer.close()
            return None
        if not isinstance(answer, dict) or answer.get("op") != "welcome":
            writer.close()
            return answer if isinstance(answer, dict) else None
        self.writer = writer
        self._spawn(_read(reader, self.inbox))
        return answer

    # -- start-up -------------------------------------------------------------------------------

    async def plan_kv(self, node: Node, requested: list[int]) -> KVPlan:
        """The engine's KV plan from every rank of every node (the leader computes it)."""
        engine = node.engine
        available = engine.available_kv(requested)
        deadline = self._deadline()
        if not self.leader:
            assert self.writer is not None
            _send(self.writer, {"op": "kv", "available": available, "requested": requested})
            plan = _plan(await self._headless_wait(node, "plan", deadline))
            engine.plan = plan
            return plan
        every_available, every_requested = list(available), list(requested)
        for rank in sorted(self.peers):
            doc = await self._leader_wait(
                node, self.peers[rank], "kv", deadline, "determine_available_memory"
            )
            every_available += [int(x) for x in doc["available"]]
            every_requested += [int(x) for x in doc["requested"]]
        plan = engine.plan_kv(every_available, every_requested)
        for peer in self.peers.values():
            _send(peer.writer, {"op": "plan", **dataclasses.asdict(plan)})
        return plan

    async def settle_blocks(self, node: Node, blocks: list[int]) -> KVPlan:
        """vLLM 0.34: the engine core's minimum of every rank's measured blocks (the leader's)."""
        engine = node.engine
        assert isinstance(engine, MeasuredEngineModel)
        deadline = self._deadline()
        if not self.leader:
            assert self.writer is not None
            _send(self.writer, {"op": "measured", "blocks": blocks})
            plan = _plan(await self._headless_wait(node, "settled", deadline))
            engine.plan = plan
            return plan
        every = list(blocks)
        for rank in sorted(self.peers):
            peer = self.peers[rank]
            doc = await self._leader_wait(node, peer, "measured", deadline, "compile_or_warm_up_model")
            every += [int(x) for x in doc["blocks"]]
        plan = engine.finalize(every)
        for peer in self.peers.values():
            _send(peer.writer, {"op": "settled", **dataclasses.asdict(plan)})
        return plan

    async def ready(self, node: Node) -> None:
        """Every node warmed up (the leader starts serving only then)."""
        if not self.leader:
            assert self.writer is not None
            _send(self.writer, {"op": "ready"})
            return
        deadline = self._deadline()
        for rank in sorted(self.peers):
            await self._leader_wait(node, self.peers[rank], "ready", deadline, "compile_or_warm_up_model")

    async def _leader_wait(
        self, node: Node, peer: _Peer, op: str, deadline: float, method: str
    ) -> dict[str, Any]:
        try:
            return await self._expect(node, peer.inbox, op, deadline)
        except _Timeout:
            raise rpc_timeout(method) from None

    async def _headless_wait(self, node: Node, op: str, deadline: float | None) -> dict[str, Any]:
        """The leader's next `op`; once the group lost a node, the timeout runs from then."""
        while True:
            if self.lost_at is not None:
                deadline = self.lost_at + self.topo.timeout_s
            try:
                doc = await self._get(node, self.inbox, deadline)
            except _Timeout:
                raise lost(self.topo) from None
            if doc is None or doc.get("op") == "lost":
                if self.lost_at is None:
                    self.lost_at = asyncio.get_running_loop().time()
                continue
            if doc.get("op") == op:
                return dict(doc)

    # -- serving --------------------------------------------------------------------------------

    def send_step(self, running: int) -> None:
        for peer in self.peers.values():
            _send(peer.writer, {"op": "step", "running": running})

    async def stepped(self, node: Node) -> None:
        """Every node's answer to the step (a lost node stalls the leader until the timeout)."""
        deadline = self._deadline()
        for rank in sorted(self.peers):
            await self._leader_wait(node, self.peers[rank], "stepped", deadline, "execute_model")

    async def serve_headless(self, node: Node) -> int:
        """A headless node's serving: each of the leader's steps on this node's ranks, until
        SIGTERM (the fake's stop) or a failure (raised: EngineFailure)."""
        assert self.writer is not None
        while True:
            doc = await self._headless_wait(node, "step", None)
            node.engine.begin_step(int(doc["running"]))
            try:
                await node.pause(self.peak_hold_s, scaled=False)
            finally:
                node.engine.end_step()
            _send(self.writer, {"op": "stepped"})

    # -- failures -------------------------------------------------------------------------------

    def report_failure(self, node: Node, failure: EngineFailure, at_startup: bool) -> bool:
        """multinode.report_failure for this node."""
        return report_failure(node, self.topo, failure, at_startup)
