"""The fake `vllm serve`: real flags, simulated GPUs, vLLM's log lines and PyTorch's OOM.

(Over 400 lines because `FakeVllm` is one process's life, start-up phases, load loop, HTTP and
every exit path, in the order vLLM runs them; its flags, output, GPUs and metrics live in vllm_*.)

    RANKGUARD_SIM_GPU_ROOT=/tmp/gpus NVIDIA_VISIBLE_DEVICES=GPU-a,GPU-b,GPU-c,GPU-d \\
    RANKGUARD_SIM_SCENARIO=llama3-70b-tp4 vllm serve meta-llama/Meta-Llama-3-70B-Instruct -tp 4

Its command is the console script of the sandbox's stand-in `vllm` package (bin/vllm,
sim/vllm_standin): `vllm.entrypoints.cli.main.main()` parses (fake_vllm/cli.py), and the serve
leaf vLLM's `cmd` picks runs `serve`/`run_args` here; `run(argv)` is the same without the package.
It parses vLLM's own flags (`vllm_args`; an unknown flag exits 2, as argparse does),
replays vLLM v1's start-up over the pod's simulated GPUs with `engine_memory.EngineMemoryModel`
(the same code `engine_outcome.outcome()` runs), prints vLLM's log lines, serves `/health`,
`/metrics` and `/v1/models`, and drives the scenario's load. When a rank runs out, it prints PyTorch's
CUDA OOM message for that GPU inside a traceback and exits 1. SIGTERM releases the GPUs and
exits 0; every exit path releases the allocation files.

A repo id whose scenario gives the model's config.json is "downloaded" into the Hugging Face
cache (hf_download): config.json and the index at once (vLLM reads the config before the
engine starts), the weight files while the workers load, at the scenario's
`download.bytes_per_second` (default 1 GB/s) over the real checkpoint's size, scaled like the
other phases; each worker then logs vLLM's "Time spent downloading weights for …" line when
that took longer than vLLM's threshold (0.5 s). Files already in the cache (a model-cache
volume) cost nothing and print nothing. `fake_vllm.sandbox.weight_downloads(log)` reads those lines back.

Not vLLM's: at start it imports `pynvml` the way the engine does (vLLM's torch imports it)
and prints where it came from on one line prefixed `rankguard-sim:`
(`vllm_sandbox.engine_pynvml(log)` reads it back), also on /metrics as
`rankguard_sim_engine_pynvml_info{file, error}`.

Network: with `--host` 0.0.0.0, ::, empty or absent and RANKGUARD_SIM_POD_IP set (the
process kubelet sets it), the server binds the pod IP: the sandbox's stand-in for a pod's
network namespace (docs/sim-world.md). An explicit address is bound as given.

Multi-node (`--nnodes N`, multinode.py and rendezvous.py): each pod plays one node of the group,
its own ranks on its own GPUs; the leader serves HTTP once every node is up (the sandbox's knob
RANKGUARD_SIM_DISTRIBUTED_TIMEOUT_S bounds the waits; RANKGUARD_SIM_HOSTS_FILE is its DNS).

Environment knobs (the sandbox's, not vLLM's):
  RANKGUARD_SIM_VLLM_VERSION     the engine's release (the kubelet sets it from the image tag):
                                 0.34 plays its extensible KV cache (startup.py), older ones 0.33
  RANKGUARD_SIM_SCENARIO         a built-in scenario name or a YAML path (default: the
                                 built-in matching the model and topology)
  RANKGUARD_SIM_GPU_ROOT         the simulated GPUs (docs/sim-world.md)
  RANKGUARD_SIM_TIME_SCALE       > 1 runs start-up and the load pattern that many times faster
  RANKGUARD_SIM_PEAK_HOLD_S      how long each transient peak is held (default 0.35 s, so the
                                 agent's 10 Hz sampler sees every one)
  RANKGUARD_SIM_FAIL_STARTUP     fail start-up with this message, exit 1 (a non-memory failure)
  RANKGUARD_SIM_HOST_MEMORY_FILE where to write {"pid", "rss_bytes", "peak_rss_bytes"} for the
                                 process kubelet's OOMKilled decision
  RANKGUARD_SIM_POD_IP           the pod's IP, bound instead of a wildcard --host
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import fcntl
import math
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from rankguard_sim.fake_vllm.args import non_default_args, parse_args
from rankguard_sim.fake_vllm.config_checks import build_config
from rankguard_sim.fake_vllm.console import (
    Console,
    failure_lines,
    init_engine_line,
    traceback_lines,
    worker_name,
)
from rankguard_sim.fake_vllm.hf_download import (
    CachedRepo,
    CheckpointFile,
    checkpoint,
    hf_hub_cache,
    is_repo_id,
    prepare,
)
from rankguard_sim.fake_vllm.ledger import FileLedger, select_gpus
from rankguard_sim.fake_vllm.metrics import Metrics
from rankguard_sim.fake_vllm.multinode import check_flags, topology
from rankguard_sim.fake_vllm.rendezvous import Group
from rankguard_sim.fake_vllm.sandbox import (
    DOWNLOAD_MESSAGE,
    ENGINE_PYNVML,
    HostMemoryReporter,
    bind_address,
    engine_pynvml_origin,
)
from rankguard_sim.fake_vllm.startup import (
    after_warmup,
    capture_start_lines,
    fall_back,
    kv_cache_size_line,
    load_start_lines,
    measured,
    print_memory_reports,
    runner,
    v1_runner,
)
from rankguard_sim.physics import gpus
from rankguard_sim.physics.engine_config import EngineConfig, EngineConfigError
from rankguard_sim.physics.engine_failures import EngineFailure
from rankguard_sim.physics.engine_measured import engine_model
from rankguard_sim.physics.engine_memory import EngineMemoryModel, KVPlan
from rankguard_sim.physics.scenario_data import Scenario, ScenarioError
from rankguard_sim.vllm_snapshot import (
    ENGINE_VERSION_ENV,
    download_log_seconds,
    format_gib,
    message,
    play,
    version,
    where,
)

TIME_SCALE_ENV = "RANKGUARD_SIM_TIME_SCALE"
PEAK_HOLD_ENV = "RANKGUARD_SIM_PEAK_HOLD_S"
FAIL_STARTUP_ENV = "RANKGUARD_SIM_FAIL_STARTUP"
HOST_MEMORY_FILE_ENV = "RANKGUARD_SIM_HOST_MEMORY_FILE"

TORCH_DTYPE = {"auto": "torch.bfloat16", "bfloat16": "torch.bfloat16", "half": "torch.float16"}

# vLLM 0.33's API server entry point (the snapshot also has the render server's)
API_ENTRY = "api_server/entry.py"

DEFAULT_PEAK_HOLD_S = 0.35  # >= 0.3 s: three samples of a 10 Hz sampler land on every peak
STEP_GAP_S = 0.05

# Unscaled seconds each start-up phase takes (plausible for a cached 70B checkpoint).
PHASE_SECONDS = {
    "init-device": 0.6,
    "load-model": 2.0,
    "profile-run": 1.0,
    "initialize-kv-cache": 0.3,
    "capture-cuda-graphs": 1.0,
    "sampler-warmup": 0.2,
}


class _Stopped(Exception):
    """SIGTERM or SIGINT arrived: release and exit 0."""


# ---------------------------------------------------------------------------------------------
# The server


@dataclass
class Settings:
    time_scale: float = 1.0
    peak_hold_s: float = DEFAULT_PEAK_HOLD_S
    fail_startup: str | None = None
    host_memory_file: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        def positive(name: str, default: float) -> float:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            value = float(raw)
            if not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a positive number, got {raw!r}")
            return value

        return cls(
            time_scale=positive(TIME_SCALE_ENV, 1.0),
            peak_hold_s=positive(PEAK_HOLD_ENV, DEFAULT_PEAK_HOLD_S),
            fail_startup=env.get(FAIL_STARTUP_ENV) or None,
            host_memory_file=env.get(HOST_MEMORY_FILE_ENV) or None,
        )


@dataclass
class FakeVllm:
    scenario: Scenario
    config: EngineConfig
    args: argparse.Namespace
    ledger: FileLedger
    settings: Settings
    console: Console
    host: HostMemoryReporter
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    env: Mapping[str, str] = field(default_factory=dict)
    group: Group | None = None  # --nnodes > 1: this node's part of the group (rendezvous.py)

    def __post_init__(self) -> None:
        ranks = None if self.group is None else self.group.ranks
        self.engine: EngineMemoryModel = engine_model(self.scenario, self.config, self.ledger, ranks)
        self.core = self.group is None or self.group.leader  # runs the engine core (and HTTP)
        self.model_name = (self.args.served_model_name or [self.args.model_tag])[0]
        self.metrics = Metrics(self.model_name)
        self.serving = False
        self.repo: CachedRepo | None = None  # the model in the Hugging Face cache, when it has one
        self.files: list[CheckpointFile] = []

    # -- pacing -------------------------------------------------------------------------------

    async def pause(self, seconds: float, *, scaled: bool = True) -> None:
        """Sleep, but wake at once on SIGTERM (raising _Stopped)."""
        delay = seconds / self.settings.time_scale if scaled else seconds
        if self.stop.is_set():
            raise _Stopped
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), timeout=max(0.0, delay))
        if self.stop.is_set():
            raise _Stopped

    def workers(self, once: bool = False) -> list[tuple[int, str]]:
        """This process's workers (global rank, name); `once`: vLLM's info_once lines, which on a
        multi-node group come from each node's local rank 0 only (the fake keeps one node's all)."""
        workers = [(m.rank, worker_name(self.scenario, m.rank)) for m in self.engine.ranks]
        return workers[:1] if once and self.group is not None else workers

    # -- start-up -----------------------------------------------------------------------------

    async def start_engine(self) -> KVPlan:
        c, s, cfg = self.console, self.scenario, self.config
        started = time.monotonic()
        self.fetch_config()
        if self.core:
            c.info(
                "EngineCore_DP0",
                "core.py:140",
                f"Initializing a V1 LLM engine (v{version()}) with config: model='{self.args.model_tag}', "
                f"dtype={TORCH_DTYPE.get(cfg.dtype, 'torch.' + cfg.dtype)}, max_seq_len={cfg.max_model_len}, "
                f"tensor_parallel_size={cfg.tensor_parallel_size}, "
                f"pipeline_parallel_size={cfg.pipeline_parallel_size}, kv_cache_dtype={cfg.kv_cache_dtype}, "
                f"enforce_eager={cfg.enforce_eager}, served_model_name={self.model_name}",
            )
        if self.settings.fail_startup:
            await self.pause(PHASE_SECONDS["init-device"])
            raise EngineStartupMessage(self.settings.fail_startup)
        if self.group is not None:
            self.group.vmm = self.ledger.vmm()
            await self.group.form(self)  # start-up waits until every node has joined
        self.engine.start_other_processes()  # the API server / engine core touching cuda:0
        self.engine.init_devices()
        await self.pause(PHASE_SECONDS["init-device"])
        requested = self.engine.check_free_memory()
        load_start_lines(self)
        await self.download_weights()
        if s.host_memory is not None:
            self.host.report(s.host_memory.after_load_bytes)  # weights are staged in host memory
        load_started = time.monotonic()
        self.engine.load_weights()
        await self.pause(PHASE_SECONDS["load-model"])
        took = time.monotonic() - load_started
        for rank, who in self.workers(once=v1_runner()):  # 0.34's V2 runner logs it on every worker
            weights = format_gib(self.engine.all_ranks[rank].weights)
            c.info(
                who,
                where("model_loading", runner()),
                message("model_loading", weights, took, file_suffix=runner()),
            )
        fall_back(self, self.ledger.vmm() if self.group is None else self.group.world_vmm)
        requested = self.engine.requested
        self.engine.profile()
        await self.pause(PHASE_SECONDS["profile-run"])
        if self.group is None:
            plan = self.engine.determine_kv(requested)
        else:  # the leader plans from every node's figures
            plan = await self.group.plan_kv(self, requested)
        for rank, who in self.workers(once=not plan.pinned):
            avail = plan.available[rank]
            if plan.pinned:
                free = self.engine.snapshot_free[self.engine.device(rank)]
                c.info(
                    who,
                    where("kv_bytes_reserved"),
                    message("kv_bytes_reserved", format_gib(free), format_gib(avail)),
                )
            else:
                c.info(who, where("available_kv_memory"), message("available_kv_memory", format_gib(avail)))
        extensible = measured(self)
        if extensible is None:  # 0.34's extensible KV cache logs it once sized, after warm-up
            kv_cache_size_line(self, plan)
        self.engine.allocate_kv()
        await self.pause(PHASE_SECONDS["initialize-kv-cache"])
        if extensible is not None:  # 0.34 warms up (through the serving path) before capture
            extensible.warm_up()
        if not cfg.enforce_eager:
            capture_start_lines(self)
            self.engine.capture_cuda_graphs()
            await self.pause(PHASE_SECONDS["capture-cuda-graphs"])
            capture_s = PHASE_SECONDS["capture-cuda-graphs"] / self.settings.time_scale
            for rank, who in self.workers(once=v1_runner()):
                graphs = self.engine.all_ranks[rank].cuda_graph / (1 << 30)
                c.info(
                    who,
                    where("cuda_graph_captured", runner()),
                    message("cuda_graph_captured", capture_s, graphs, file_suffix=runner()),
                )
        print_memory_reports(self)
        self.engine.warm_up_sampler()
        await self.pause(PHASE_SECONDS["sampler-warmup"])
        if extensible is not None:
            plan = await after_warmup(self, extensible)
        if self.group is not None:
            await self.group.ready(self)
        if self.core:
            c.info("EngineCore_DP0", *init_engine_line(time.monotonic() - started))
        self.metrics.set_cache_config(self.config, plan)  # fall_back may have replaced it
        return plan

    def fetch_config(self) -> None:
        """A repo id's config.json and index into the Hugging Face cache (vLLM reads the config
        before the engine starts), when the scenario gives the model's config.json."""
        config, tag = self.scenario.model_config, str(self.args.model_tag)
        if config is None or not is_repo_id(tag):
            return
        cache = Path(self.args.download_dir) if self.args.download_dir else hf_hub_cache(self.env)
        self.repo = prepare(cache, tag, config, self.args.revision)
        self.files = checkpoint(config)
        for f in self.files:
            if not f.weights:
                self.repo.store(f)

    async def download_weights(self) -> None:
        """vLLM's download_weights_from_hf, in every worker: the weight files not in the cache
        come in one by one, each `nbytes / download rate` (scaled) seconds under
        huggingface_hub's lock for that file (a second process sharing the cache waits for it,
        then finds it there). Each worker logs the time spent when it is over vLLM's threshold."""
        repo = self.repo
        if repo is None:
            return
        started = time.monotonic()
        for f in self.files:
            if f.weights and not repo.has(f.name):
                await self.fetch(repo, f)
        took = time.monotonic() - started
        if took > download_log_seconds():
            for _, who in self.workers():
                self.console.info(
                    who,
                    where(DOWNLOAD_MESSAGE),
                    message(DOWNLOAD_MESSAGE, str(self.args.model_tag), took),
                )

    async def fetch(self, repo: CachedRepo, f: CheckpointFile) -> None:
        lock = repo.lock_path(f)
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await self.pause(0.05, scaled=False)
            if not repo.has(f.name):
                await self.pause(self.scenario.download.seconds(f.nbytes))
                repo.store(f)
        finally:
            os.close(fd)  # and with it the lock

    def record_pynvml(self) -> None:
        """Import pynvml as the engine does (vLLM's torch imports it) and say where it came from."""
        file, error = engine_pynvml_origin()
        self.console.plain(f"{ENGINE_PYNVML} {file}" if file else f"{ENGINE_PYNVML} not imported ({error})")
        self.metrics.set_engine_pynvml(file, error)

    # -- serving ------------------------------------------------------------------------------

    async def step(self, running: int, demand: int, plan: KVPlan) -> None:
        """One visible transient: allocate this batch's logits, hold, release."""
        if self.group is not None:
            self.group.send_step(running)  # every node runs the step on its own ranks
        self.engine.begin_step(running)
        per_seq = math.ceil(self.scenario.load.tokens_per_seq / self.config.block_size)
        # BlockPool.get_usage: used / (num_blocks - 1), the null block left out
        usage = min(1.0, running * per_seq / plan.usable_blocks) if plan.usable_blocks else 0.0
        self.metrics.set_load(running, max(0, demand - running), usage)
        try:
            await self.pause(self.settings.peak_hold_s, scaled=False)
        finally:
            self.engine.end_step()
        if self.group is not None:
            await self.group.stepped(self)  # a lost node stalls the step until the timeout
        await self.pause(STEP_GAP_S, scaled=False)

    async def drive_load(self, plan: KVPlan) -> None:
        load = self.scenario.load
        demands = load.demand_levels()
        levels = self.engine.running_levels()
        level_s = load.ramp_seconds / load.ramp_levels
        while True:
            self.metrics.set_load(0, 0, 0.0)
            await self.idle(load.idle_seconds)
            for running, demand in zip(levels, demands, strict=True):
                await self.hold_level(running, demand, plan, level_s)
            await self.hold_level(levels[-1], demands[-1], plan, load.hold_seconds)

    async def idle(self, seconds: float) -> None:
        end = time.monotonic() + seconds / self.settings.time_scale
        while True:
            self.engine.check_gpus("execute-model")
            left = end - time.monotonic()
            if left <= 0:
                return
            await self.pause(min(left, 0.2), scaled=False)

    async def hold_level(self, running: int, demand: int, plan: KVPlan, seconds: float) -> None:
        end = time.monotonic() + seconds / self.settings.time_scale
        await self.step(running, demand, plan)  # every level shows at least one peak
        while time.monotonic() < end:
            await self.step(running, demand, plan)

    async def start_http(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/v1/models", self.handle_models)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        host = self.args.host or "0.0.0.0"
        await web.TCPSite(runner, bind_address(self.args.host, self.env), self.args.port).start()
        self.console.info(
            "APIServer",
            where("api_server_start", API_ENTRY),
            message("api_server_start", f"http://{host}:{self.args.port}", file_suffix=API_ENTRY),
        )
        self.console.plain("INFO:     Application startup complete.")
        return runner

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.serving else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_models(self, request: web.Request) -> web.Response:
        names = self.args.served_model_name or [self.args.model_tag]
        data = [
            {
                "id": n,
                "object": "model",
                "owned_by": "vllm",
                "root": self.args.model_tag,
                "max_model_len": self.engine.plan.max_model_len
                if self.engine.plan is not None
                else self.config.max_model_len,
            }
            for n in names
        ]
        return web.json_response({"object": "list", "data": data})

    # -- lifecycle ----------------------------------------------------------------------------

    def report_failure(self, failure: EngineFailure, *, at_startup: bool) -> None:
        c = self.console
        if self.group is not None and self.group.report_failure(self, failure, at_startup):
            return  # a headless node's, or the group's own (rendezvous.py)
        who = "EngineCore_DP0" if failure.rank is None else worker_name(self.scenario, failure.rank)
        where = "core.py:718" if self.scenario.world_size == 1 else "multiproc_executor.py:671"
        lines = failure_lines(failure)
        c.error_lines(
            who,
            where,
            ["WorkerProc hit an exception." if not at_startup else "WorkerProc failed to start.", *lines],
        )
        if at_startup:
            c.engine_failed_to_start([lines[-1]])
            return
        c.engine_died(
            f"RuntimeError: Worker failed with error '{failure.message()}', "
            "please check the stack trace above for the root cause"
        )

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        runner: web.AppRunner | None = None
        try:
            self.record_pynvml()
            if self.scenario.host_memory is not None:
                self.host.report(self.scenario.host_memory.baseline_bytes)
            try:
                plan = await self.start_engine()
            except EngineFailure as failure:
                self.report_failure(failure, at_startup=True)
                return 1
            except EngineStartupMessage as failed:
                lines = traceback_lines(
                    [("v1/engine/core.py", 500, "__init__", "self._init_executor()")],
                    f"RuntimeError: {failed}",
                )
                self.console.engine_failed_to_start(lines)
                return 1
            if not self.core:  # a headless node serves no HTTP: it steps with its leader
                try:
                    return await self.group.serve_headless(self) if self.group else 0
                except EngineFailure as failure:
                    self.report_failure(failure, at_startup=False)
                    return 1
            try:
                runner = await self.start_http()
            except OSError as e:
                self.console.plain(f"OSError: [Errno {e.errno}] {e.strerror}", error=True)
                return 1
            self.serving = True
            try:
                await self.drive_load(plan)
            except EngineFailure as failure:
                self.serving = False
                self.report_failure(failure, at_startup=False)
                return 1
            return 0  # drive_load only ends by raising
        except _Stopped:
            if self.core:  # uvicorn's lines; a headless node's process just ends
                self.console.plain("INFO:     Shutting down")
                self.console.plain(f"INFO:     Finished server process [{self.console.pid}]")
            return 0
        finally:
            self.serving = False
            self.ledger.release_all()
            if runner is not None:
                await runner.cleanup()


class EngineStartupMessage(Exception):
    """RANKGUARD_SIM_FAIL_STARTUP: a start-up failure that has nothing to do with memory."""


# ---------------------------------------------------------------------------------------------
# Entry point


def _fail(console: Console, text: str) -> int:
    console.plain(text, error=True)
    return 1


def run(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """`vllm serve` with these arguments (argv without `vllm`), to the end: its exit status."""
    env = os.environ if env is None else env
    play(env.get(ENGINE_VERSION_ENV))  # the image's release: its flags, lines and sizing
    args = parse_args(argv)  # exits 2 on a bad command line, before anything else
    return run_args(args, env)


def run_args(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """Serve parsed flags to the end (the stand-in `vllm` package's synchronous serve leaves)."""
    prepared = start(args, env)
    return prepared if isinstance(prepared, int) else asyncio.run(prepared.run())


async def serve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    """`run_args` inside a running event loop (the stand-in's async `run_server` leaf)."""
    prepared = start(args, env)
    return prepared if isinstance(prepared, int) else await prepared.run()


def start(args: argparse.Namespace, env: Mapping[str, str]) -> FakeVllm | int:
    """Everything before the engine runs: the API server's lines, the configuration (vLLM's
    refusals, config_checks.py), the GPUs; an int is the exit status of a start that failed."""
    if args.model_tag is None:
        args.model_tag = args.model  # vLLM: no positional, so --model's value (or its default)
    pid = os.getpid()
    console = Console(pid)
    if not (args.headless and args.nnodes > 1):  # a headless node runs no API server
        console.info(
            "APIServer",
            "api_server.py:1805",
            f"vLLM API server version {version()} (simulated by rankguard_sim)",
        )
        console.info("APIServer", "startup.py:96", f"non-default args: {non_default_args(args)}")
    try:
        settings = Settings.from_env(env)
        refused = check_flags(args)  # vLLM's refusals of --nnodes flags, then the sandbox's
        if refused is not None:
            raise ValueError(refused)
        topo = topology(args, env, settings.time_scale)
    except ValueError as e:
        return _fail(console, f"ValueError: {e}")
    try:
        built = build_config(args, env)  # what vLLM's create_engine_config would refuse
    except (ScenarioError, EngineConfigError) as e:
        return _fail(console, f"ValueError: {e}")
    scenario, config = built.scenario, built.engine
    root = env.get(gpus.GPU_ROOT_ENV)
    uuids = select_gpus(env)
    if not root or not uuids:
        return _fail(console, "RuntimeError: No CUDA GPUs are available")
    local = scenario.world_size if topo is None else topo.local_world_size
    if len(uuids) < local:
        if topo is not None:  # vLLM checks a node's GPUs only on one node: here torch.cuda fails
            return _fail(console, "RuntimeError: CUDA error: invalid device ordinal")
        return _fail(
            console,
            f"ValueError: World size ({scenario.world_size}) is larger than the number of available GPUs "
            f"({len(uuids)}) in this node.",
        )
    try:
        ledger = FileLedger(root, uuids[:local], pid=pid)
    except gpus.SimGpuError as e:
        return _fail(console, f"RuntimeError: CUDA error: invalid device ordinal ({e})")
    atexit.register(ledger.release_all)  # whatever happens below, the GPUs are given back
    return FakeVllm(
        scenario=scenario,
        config=config,
        args=args,
        ledger=ledger,
        settings=settings,
        console=console,
        host=HostMemoryReporter(settings.host_memory_file, pid),
        env=env,
        group=None if topo is None else Group(topo, env, console, settings.peak_hold_s),
    )


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    main()
