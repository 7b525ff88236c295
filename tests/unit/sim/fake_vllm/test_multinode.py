"""The fake vLLM as a multi-node group (`--nnodes 2`, vLLM 0.33's mp backend, 0.34's at the end): two
processes, a leader and a headless node, each on its own pod's simulated GPUs, meeting over the
sandbox's rendezvous (fake_vllm/rendezvous.py) and resolving the leader's name through the sandbox's DNS
file (kube/dns.py). Run for real, as subprocesses; every wait is on a condition.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankguard_agent.gpu.simfiles import VISIBLE_DEVICES_ENV
from rankguard_sim.fake_vllm.console import ENGINE_DEAD, ENGINE_INIT_FAILED
from rankguard_sim.fake_vllm.main import PEAK_HOLD_ENV, TIME_SCALE_ENV
from rankguard_sim.fake_vllm.main import run as run_fake
from rankguard_sim.fake_vllm.multinode import DISTRIBUTED_TIMEOUT_ENV
from rankguard_sim.kube.cluster import free_ports
from rankguard_sim.kube.dns import HOSTS_FILE_ENV, render_hosts
from rankguard_sim.physics import gpus
from rankguard_sim.physics.engine_config import engine_config
from rankguard_sim.physics.engine_failures import KV_CACHE_TOO_SMALL
from rankguard_sim.physics.engine_memory import EngineMemoryModel, PureLedger
from rankguard_sim.physics.engine_outcome import outcome
from rankguard_sim.physics.neighbour import start_neighbour
from rankguard_sim.physics.scenario_file import SCENARIO_ENV, load_scenario
from rankguard_sim.vllm_snapshot import (
    ENGINE_VERSION_ENV,
    format_gib,
    message,
    message_pattern,
    playing,
    version,
)
from rankguard_sim.waiting import wait_for
from tests import REPO

SHIM = REPO / "sim" / "rankguard_sim" / "bin" / "vllm"
SCENARIO = "llama3-70b-tp8-pp2-2nodes"
MODEL = "meta-llama/Llama-3.1-70B-Instruct"
LEADER_NAME = "llm-0.llm-group.team-a"  # <hostname>.<headless service>.<namespace>
POD_IPS = ("127.0.0.221", "127.0.0.222", "127.0.0.223")  # leader, headless, a late headless
TIMEOUT_S = 3  # RANKGUARD_SIM_DISTRIBUTED_TIMEOUT_S: how long a group stalls on a lost node
SAFE_UTILISATION = "0.88"  # the world never runs out at this utilisation (asserted below)
OOM = re.compile(r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate \S+ \S+\. GPU (\d+) ")
WORKER = re.compile(r"^\((Worker_PP\d_TP\d) pid=\d+\) ", re.M)


def endpoint_slice(leader_ip: str) -> dict[str, object]:
    """What the EndpointSlice controller publishes for the group's headless Service."""
    return {
        "metadata": {"namespace": "team-a", "labels": {"kubernetes.io/service-name": "llm-group"}},
        "endpoints": [{"addresses": [leader_ip], "hostname": "llm-0", "conditions": {"ready": True}}],
    }


class Group:
    """Fake vLLM processes as the pods of one group: pod `i` has GPUs 8i..8i+7 of one root."""

    def __init__(self, tmp_path: Path) -> None:
        self.s = load_scenario(SCENARIO)
        self.tmp = tmp_path
        self.root = tmp_path / "gpus"
        self.uuids = gpus.create_gpus(self.root, 24, self.s.gpu.total_bytes, seed="group")
        for i, uuid in enumerate(self.uuids):  # a pod's i-th GPU is its node's rank 8 × node + i
            gpus.set_comm_init_bytes(self.root, uuid, self.s.comm_init_bytes(i % 16))
        self.hosts = tmp_path / "dns" / "hosts"
        self.hosts.parent.mkdir()
        self.hosts.write_text(render_hosts([endpoint_slice(POD_IPS[0])]))
        self.master_port, self.http_port = free_ports(2)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[tuple[Path, Path]] = []

    def gpus_of(self, pod: int) -> list[str]:
        return self.uuids[8 * pod : 8 * pod + 8]

    def start(self, pod: int, node_rank: int, *flags: str, **env: str) -> subprocess.Popen[bytes]:
        """Pod `pod` (its GPUs and IP) as node `node_rank`: the leader (0) or a headless node."""
        args = ["serve", MODEL, "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"]
        args += ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", LEADER_NAME]
        args += ["--master-port", str(self.master_port), "--host", "0.0.0.0", "--port", str(self.http_port)]
        args += [*(["--headless"] if node_rank else []), *flags]
        full_env = {
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO / "sim"),
            "HOME": str(self.tmp / f"home{pod}"),
            gpus.GPU_ROOT_ENV: str(self.root),
            VISIBLE_DEVICES_ENV: ",".join(self.gpus_of(pod)),
            "RANKGUARD_SIM_POD_IP": POD_IPS[pod],
            HOSTS_FILE_ENV: str(self.hosts),
            DISTRIBUTED_TIMEOUT_ENV: str(TIMEOUT_S),
            TIME_SCALE_ENV: "50",
            PEAK_HOLD_ENV: "0.05",
            **env,
        }
        out, err = self.tmp / f"pod{pod}-{len(self.procs)}.out", self.tmp / f"pod{pod}-{len(self.procs)}.err"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen([str(SHIM), *args], stdout=o, stderr=e, env=full_env)
        self.procs.append(proc)
        self.logs.append((out, err))
        return proc

    def out(self, proc: subprocess.Popen[bytes]) -> str:
        return self.logs[self.procs.index(proc)][0].read_text()

    def err(self, proc: subprocess.Popen[bytes]) -> str:
        return self.logs[self.procs.index(proc)][1].read_text()

    def health(self, pod: int) -> int:
        try:
            url = f"http://{POD_IPS[pod]}:{self.http_port}/health"
            with urllib.request.urlopen(url, timeout=2) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except OSError:
            return 0

    def held_by(self, proc: subprocess.Popen[bytes]) -> set[str]:
        """The GPUs a process holds memory on (its allocation files)."""
        return {p.parent.parent.name for p in self.root.glob(f"*/procs/{proc.pid}-vllm.json")}

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    g = Group(tmp_path)
    try:
        yield g
    finally:
        g.close()


def exited(proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    """The exit code, once the process has ended (waited for, never assumed)."""
    return proc.wait(timeout=timeout)


def the_plan(utilisation: float) -> tuple[int, int]:
    """(engine blocks over all 16 ranks, blocks node 0's ranks alone would give) at `utilisation`."""
    s = load_scenario(SCENARIO)
    engine = EngineMemoryModel(s, engine_config(s, gpu_memory_utilization=utilisation), PureLedger([0] * 16))
    requested = [math.ceil(s.gpu.total_bytes * utilisation)] * 16
    plan = engine.plan_kv(engine.available_kv(requested), requested)
    node0 = min(plan.available[r] // engine.all_ranks[r].block_bytes for r in range(8))
    return plan.num_gpu_blocks, node0


# -- a group that serves ------------------------------------------------------------------------


def test_the_group_starts_once_both_nodes_joined_and_only_the_leader_serves(group: Group) -> None:
    assert not outcome(group.s, gpu_memory_utilization=float(SAFE_UTILISATION)).crashes
    leader = group.start(0, 0, "--gpu-memory-utilization", SAFE_UTILISATION)
    wait_for(
        "the leader to wait for its group", lambda: "waiting for 1 node(s)" in group.out(leader), 30, 0.05
    )
    assert "Starting to load model" not in group.out(leader)
    headless = group.start(1, 1, "--gpu-memory-utilization", SAFE_UTILISATION)
    wait_for("the leader to serve", lambda: group.health(0) == 200 or leader.poll() is not None, 60, 0.05)
    assert group.health(0) == 200, group.err(leader)[-3000:]

    lead, node1 = group.out(leader), group.out(headless)
    # Start-up waited for the headless node: in the leader's own (ordered) output the group formed
    # before any worker began loading.
    assert lead.index("group formed: 2 nodes, 16 ranks") < lead.index("Starting to load model")
    assert re.search(
        r"DP group leader: node_rank=0, node_rank_within_dp=0, master_addr=llm-0\.llm-group\.team-a, "
        r"mq_connect_ip=127\.0\.0\.221 \(local\), world_size=16, local_world_size=8",
        lead,
    )
    launch = message("headless_launch", version(), f"{LEADER_NAME}:{group.master_port}")
    assert re.search(rf"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[serve\.py:\d+\] {re.escape(launch)}$", node1, re.M)

    # Each pod prints its own workers' lines, named by their global ranks.
    assert set(WORKER.findall(lead)) == {f"Worker_PP0_TP{i}" for i in range(8)}
    assert set(WORKER.findall(node1)) == {f"Worker_PP1_TP{i}" for i in range(8)}
    for log in (lead, node1):
        assert log.count("Free memory on device (") == 8  # the memory report: every worker
        assert log.count("Available KV cache memory: ") == 1  # info_once: local rank 0 only
        assert log.count("Starting to load model") == 1
    s = group.s
    requested = math.ceil(s.gpu.total_bytes * float(SAFE_UTILISATION))
    engine = EngineMemoryModel(
        s, engine_config(s, gpu_memory_utilization=float(SAFE_UTILISATION)), PureLedger([0] * 16)
    )
    stage1 = engine.available_kv([requested] * 16)[8]
    assert f"(Worker_PP1_TP0 pid={headless.pid})" in node1
    assert message("available_kv_memory", format_gib(stage1)) in node1

    # The engine-wide KV line: the leader's alone, with the group's minimum (node 1's blocks).
    blocks, node0_blocks = the_plan(float(SAFE_UTILISATION))
    assert blocks < node0_blocks
    kv_line = message("kv_cache_size", "GPU", f"{blocks * 16:,}", "131,072", blocks / (131072 // 16))
    assert lead.count(kv_line) == 1 and "KV cache size" not in node1
    assert "Application startup complete." in lead and "Application startup complete." not in node1

    # Only the leader serves HTTP; each pod holds memory on its own GPUs only.
    assert group.health(1) == 0
    assert group.held_by(leader) == set(group.gpus_of(0))
    assert group.held_by(headless) == set(group.gpus_of(1))

    # A headless node SIGTERMed goes as today (exit 0, its GPUs released); its leader stalls on
    # the next step until the distributed timeout, then fails as vLLM's engine core does.
    headless.send_signal(signal.SIGTERM)
    assert exited(headless) == 0
    assert group.held_by(headless) == set()
    assert exited(leader, 30) == 1
    err = group.err(leader)
    assert f"TimeoutError: {message('rpc_timed_out', 'execute_model')}" in err
    assert "EngineCore encountered a fatal error." in err and ENGINE_DEAD in err
    assert "lost node rank 1" in group.out(leader)
    assert group.held_by(leader) == set()


def test_sigterm_stops_the_leader_as_today_and_its_headless_node_follows_after_the_timeout(
    group: Group,
) -> None:
    leader = group.start(0, 0, "--gpu-memory-utilization", SAFE_UTILISATION)
    headless = group.start(1, 1, "--gpu-memory-utilization", SAFE_UTILISATION)
    wait_for("the leader to serve", lambda: group.health(0) == 200 or leader.poll() is not None, 60, 0.05)
    leader.send_signal(signal.SIGTERM)
    assert exited(leader) == 0
    assert "INFO:     Shutting down" in group.out(leader)
    assert group.held_by(leader) == set()
    lost_at = time.monotonic()
    assert exited(headless, 30) == 1
    assert time.monotonic() - lost_at >= TIMEOUT_S / 2  # it stalled for the distributed timeout
    assert message("broadcast_wait", TIMEOUT_S) in group.out(headless)
    assert "lost its group" in group.err(headless)
    assert group.held_by(headless) == set()


def test_a_headless_node_that_never_answers_stalls_the_leader_until_the_timeout(group: Group) -> None:
    leader = group.start(0, 0, "--gpu-memory-utilization", SAFE_UTILISATION)
    headless = group.start(1, 1, "--gpu-memory-utilization", SAFE_UTILISATION)
    wait_for("the leader to serve", lambda: group.health(0) == 200 or leader.poll() is not None, 60, 0.05)
    headless.send_signal(signal.SIGSTOP)  # alive, its connection open, but it never answers a step
    frozen = time.monotonic()
    try:
        assert exited(leader, 30) == 1
        assert time.monotonic() - frozen >= TIMEOUT_S / 2
        assert f"TimeoutError: {message('rpc_timed_out', 'execute_model')}" in group.err(leader)
        assert "lost node rank" not in group.out(leader)  # its connection never dropped
    finally:
        headless.send_signal(signal.SIGCONT)


# -- a node that runs out -----------------------------------------------------------------------


def test_an_oom_on_the_headless_node_fails_that_pod_and_the_leader_after_the_timeout(group: Group) -> None:
    expected = outcome(group.s)  # the default utilisation: rank 8 runs out while serving
    assert expected.crashes and expected.rank == 8 and expected.phase == "execute-model"
    leader = group.start(0, 0)
    headless = group.start(1, 1)
    assert exited(headless) == 1
    gone = time.monotonic()
    err1 = group.err(headless)
    found = OOM.search(err1)
    assert found and found.group(1) == "0", err1[-3000:]  # PyTorch's "GPU 0": node 1's first GPU
    assert f"(Worker_PP1_TP0 pid={headless.pid}) ERROR" in err1 and "WorkerProc hit an exception." in err1
    assert group.held_by(headless) == set()
    assert exited(leader, 30) == 1
    assert time.monotonic() - gone >= TIMEOUT_S / 2  # the leader stalled for the timeout
    err0 = group.err(leader)
    assert OOM.search(err0) is None  # the OOM is node 1's: the leader never prints it
    assert f"TimeoutError: {message('rpc_timed_out', 'execute_model')}" in err0
    assert "Application startup complete." in group.out(leader)


def test_an_oom_at_start_up_on_the_headless_node_ends_it_as_a_headless_vllm(group: Group) -> None:
    s = group.s
    block = engine_config(s).block_size * 20480
    budget = (outcome(s).num_gpu_blocks + 20_000) * block  # more than node 1's GPUs can hold
    leader = group.start(0, 0, "--kv-cache-memory-bytes", str(budget))
    headless = group.start(1, 1, "--kv-cache-memory-bytes", str(budget))
    assert exited(headless) == 1
    err1 = group.err(headless)
    assert OOM.search(err1), err1[-3000:]
    assert "WorkerProc failed to start." in err1
    assert f"Exception: {message('worker_init_failed')}" in err1
    assert exited(leader, 30) == 1


def test_the_engine_cores_kv_check_over_every_node_fails_on_node_1s_figure(group: Group) -> None:
    tight = "0.153"  # node 0's ranks could hold one 131,072-token request, node 1's cannot
    expected = outcome(group.s, gpu_memory_utilization=float(tight))
    assert expected.reason == KV_CACHE_TOO_SMALL and expected.rank == 8
    leader = group.start(0, 0, "--gpu-memory-utilization", tight)
    headless = group.start(1, 1, "--gpu-memory-utilization", tight)
    assert exited(leader) == 1
    err = group.err(leader)
    assert f"ValueError: {expected.message}" in err and ENGINE_INIT_FAILED in err
    assert "(EngineCore_DP0 pid=" in err and "Worker_PP1" not in err  # the engine core's check
    assert exited(headless, 30) == 1  # its leader gone, it waits out the timeout
    assert "lost its group" in group.err(headless)


# -- rendezvous refusals and timeouts ----------------------------------------------------------


def test_a_late_headless_node_is_refused_and_exits_after_its_timeout(group: Group) -> None:
    leader = group.start(0, 0, "--gpu-memory-utilization", SAFE_UTILISATION)
    headless = group.start(1, 1, "--gpu-memory-utilization", SAFE_UTILISATION)
    wait_for("the leader to serve", lambda: group.health(0) == 200 or leader.poll() is not None, 60, 0.05)
    late = group.start(2, 1, "--gpu-memory-utilization", SAFE_UTILISATION)  # node 1 "restarted"
    assert exited(late, 30) == 1
    out, err = group.out(late), group.err(late)
    assert "refused node rank 1: the group has formed" in out
    connect = message("client_connect_timeout", f"{TIMEOUT_S}s", LEADER_NAME, group.master_port)
    assert err.count(f"torch.distributed.DistNetworkError: {connect}") == 8  # each of its workers
    assert f"Exception: {message('worker_init_failed')}" in err
    assert "Starting to load model" not in out and group.held_by(late) == set()
    assert "refused node rank 1 from 127.0.0.223" in group.out(leader)
    assert leader.poll() is None and headless.poll() is None and group.health(0) == 200


def test_a_leader_whose_group_never_forms_fails_at_the_timeout_without_loading(group: Group) -> None:
    leader = group.start(0, 0)
    assert exited(leader, 30) == 1
    err = group.err(leader)
    joined = message("store_clients_timeout", TIMEOUT_S, 8, 16)
    assert f"torch.distributed.DistStoreError: {joined}" in err
    assert "(Worker pid=" in err and "WorkerProc failed to start." in err and ENGINE_INIT_FAILED in err
    assert "Starting to load model" not in group.out(leader)
    assert group.held_by(leader) == set()


def test_a_headless_node_that_cannot_resolve_its_leader_times_out(group: Group) -> None:
    group.hosts.write_text(render_hosts([]))  # no EndpointSlice has published the leader yet
    headless = group.start(1, 1)
    assert exited(headless, 30) == 1
    connect = message("client_connect_timeout", f"{TIMEOUT_S}s", LEADER_NAME, group.master_port)
    assert f"torch.distributed.DistNetworkError: {connect}" in group.err(headless)


def test_the_leader_name_resolves_once_dns_publishes_it(group: Group) -> None:
    """The leader's name is not in the DNS file when the headless node starts: it retries."""
    group.hosts.write_text(render_hosts([]))
    leader = group.start(
        0, 0, "--gpu-memory-utilization", SAFE_UTILISATION, **{DISTRIBUTED_TIMEOUT_ENV: "30"}
    )
    headless = group.start(
        1, 1, "--gpu-memory-utilization", SAFE_UTILISATION, **{DISTRIBUTED_TIMEOUT_ENV: "30"}
    )
    wait_for("the leader to listen", lambda: "waiting for 1 node(s)" in group.out(leader), 30, 0.05)
    assert "joined the leader" not in group.out(headless)
    group.hosts.write_text(render_hosts([endpoint_slice(POD_IPS[0])]))
    wait_for("the leader to serve", lambda: group.health(0) == 200 or leader.poll() is not None, 60, 0.05)
    assert "joined the leader" in group.out(headless)


# -- vLLM's refusals of multi-node flags ---------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "refusal"),
    [
        (["--nnodes", "3"], message("nnodes_world_size", 3, 16)),
        (["--nnodes", "2", "--node-rank", "2", "--headless"], message("node_rank_range", 1, 2)),
        (["--nnodes", "2", "--data-parallel-backend", "ray"], message("nnodes_backend", 2, "ray")),
        (["--nnodes", "2", "--distributed-executor-backend", "ray"], message("nnodes_executor_backend")),
    ],
)
def test_bad_multi_node_flags_are_refused_in_vllm_s_words(
    flags: list[str], refusal: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", MODEL, "-tp", "8", "-pp", "2", *flags]
    assert run_fake(argv, {SCENARIO_ENV: SCENARIO}) == 1
    assert f"ValueError: {refusal}" in capsys.readouterr().err


def test_a_node_needs_its_local_world_of_gpus(group: Group, capsys: pytest.CaptureFixture[str]) -> None:
    env = {gpus.GPU_ROOT_ENV: str(group.root), VISIBLE_DEVICES_ENV: ",".join(group.uuids[:4])}
    argv = ["serve", MODEL, "-tp", "8", "-pp", "2", "--nnodes", "2"]
    assert run_fake(argv, env) == 1
    assert "RuntimeError: CUDA error: invalid device ordinal" in capsys.readouterr().err


# -- vLLM 0.34: the measured minimum spans the group --------------------------------------------

V034 = {ENGINE_VERSION_ENV: "0.34.0"}


def warmup_blocks(log: str) -> dict[str, int]:
    """Worker -> the blocks its "Memory after warmup" line says fit (0.34.0's format)."""
    with playing("0.34.0"):
        pattern = message_pattern("memory_after_warmup")
    found = {}
    for line in log.splitlines():
        m, who = pattern.search(line), WORKER.match(line)
        if m and who:
            found[who.group(1)] = int(m.group(6))
    return found


def test_034_each_pod_measures_and_the_leader_takes_the_minimum_of_all(group: Group) -> None:
    neighbour = start_neighbour(group.root, group.gpus_of(1)[3], 4 << 30)  # on global rank 11's GPU
    try:
        leader = group.start(0, 0, **V034)
        headless = group.start(1, 1, **V034)
        wait_for("the leader to serve", lambda: group.health(0) == 200 or leader.poll() is not None, 60, 0.05)
        assert group.health(0) == 200, group.err(leader)[-3000:]
    finally:
        neighbour.stop()
    lead, node1 = group.out(leader), group.out(headless)
    blocks = {**warmup_blocks(lead), **warmup_blocks(node1)}
    assert len(blocks) == 16  # every worker of both pods measured
    least = min(blocks.values())
    assert blocks["Worker_PP1_TP3"] == least < max(blocks.values())  # the neighbour's GPU
    with playing("0.34.0"):
        line = re.escape(message("extensible_kv_extended", least, 0.0)).replace(r"0\.00", r"[\d.]+")
    assert len(re.findall(line, lead)) == 8 and len(re.findall(line, node1)) == 8
    assert "KV cache size: " in lead and "KV cache size: " not in node1


def test_034_a_pod_without_vmm_turns_it_off_for_the_whole_group(group: Group) -> None:
    for uuid in group.gpus_of(1):
        gpus.set_vmm(group.root, uuid, False)
    flags = ("--gpu-memory-utilization", SAFE_UTILISATION)
    leader = group.start(0, 0, *flags, **V034)
    headless = group.start(1, 1, *flags, **V034)
    wait_for("the leader to serve", lambda: group.health(0) == 200 or leader.poll() is not None, 60, 0.05)
    assert group.health(0) == 200, group.err(leader)[-3000:]
    lead, node1 = group.out(leader), group.out(headless)
    assert "Disabling the extensible KV cache: " in lead
    assert "Memory after warmup" not in lead + node1
