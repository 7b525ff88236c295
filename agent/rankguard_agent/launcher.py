"""The launcher: `python -m rankguard_agent launch [--probe] -- vllm serve …`.

It optionally probes the ranks, starts the sampler and the server, asks the image's own vLLM
to judge the engine's argv (judge_run.py: a refusal ends the container with vLLM's words and
exit code 2, the engine never started), runs the engine as a child, passes its stdout and
stderr through byte for byte while a copy is scanned line by line, forwards signals, and when
the child exits writes the termination message and exits with the child's code (128 + N when a
signal N killed it, as a shell would).

(Over 450 lines because it is one sequence, probe, start, judge, watch and verdict, each step
writing the termination log its own way: while the engine runs, the verdict a SIGKILL would get;
at its exit, the real one. What a line means and what a verdict says live beside it, in wire/ and
verdict.py.)

Bad input never takes the engine down: oversized or non-UTF-8 lines are cut or replaced
for scanning only, an unwritable stdout or termination log is logged once and ignored.

The engine never sees the agent bundle: its folder is taken off the child's PYTHONPATH
(`engine_env`), so the bundle's pynvml cannot shadow the image's own. `engine_started`
tells the bundle's entry (`rankguard-agent`) whether a failure came before the engine
existed, when it can still run the engine without the agent.

On a pod of a vLLM multi-node group (`--nnodes N --node-rank R` in the engine's argv, read by
`wire.group.read_group`) every rank the agent reports, probes or names in its termination
message is vLLM's GLOBAL rank; nothing in it needs vLLM's HTTP server, which a `--headless`
pod does not run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import importlib.metadata
import logging
import os
import re
import signal
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rankguard_agent.constants import DEFAULT_TERMINATION_LOG, DRAIN_SECONDS
from rankguard_agent.engine_metrics import engine_http
from rankguard_agent.judge_run import (
    ACCEPTED,
    DEFAULT_JUDGE_TIMEOUT,
    REFUSED,
    UNJUDGED,
    Judged,
    judge_engine_args,
)
from rankguard_agent.model_files import ModelFiles
from rankguard_agent.model_watch import ModelWatch
from rankguard_agent.others import PodProcesses
from rankguard_agent.probe import ProbeConfig, probe_pod
from rankguard_agent.runtime import AgentRuntime, RuntimeConfig
from rankguard_agent.server import AgentState
from rankguard_agent.streams import LineScanner, Output, pump
from rankguard_agent.verdict import termination_message, with_place
from rankguard_agent.wire.group import SINGLE_NODE, GroupPlace, read_group
from rankguard_agent.wire.phases import LOAD_MARKERS, PhaseTracker
from rankguard_agent.wire.recognisers import (
    AVAILABLE_KV,
    KV_TOO_SMALL,
    MODEL_LOADING,
    CudaGraphPool,
    CudaOom,
    InitialFree,
    KVObservation,
    KVTooSmall,
    Recognised,
    Unparsed,
    WorkerMemoryReport,
    recognise_all,
)
from rankguard_agent.wire.recognisers_extensible import AfterWarmup, ExtensibleDisabled
from rankguard_agent.wire.report import MAX_TEXT, EngineMemory
from rankguard_agent.wire.termination import ENGINE_REFUSED, PHASE_WEIGHTS, SIGNALED, TerminationMessage
from rankguard_agent.workers import ParallelSizes, WorkerRanks, parallel_sizes

log = logging.getLogger("rankguard_agent.launcher")

FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)

# Set once this process has started an engine child. The bundle's entry reads it (through
# sys.modules, never importing) after an exception: before the engine existed it runs the
# engine itself, after it must not start a second one.
engine_started = False


def bundle_dir() -> str:
    """The folder this package was imported from: the agent bundle's root in a serving pod."""
    return str(Path(__file__).resolve().parents[1])


def engine_env(env: Mapping[str, str], bundle: str) -> dict[str, str]:
    """`env` for the engine child, without the agent bundle's folder on PYTHONPATH.

    The bundle carries its own pynvml; on the engine's path it would shadow the image's
    nvidia-ml-py. Every other entry stays, in order; PYTHONPATH goes when none is left.
    """
    out = dict(env)
    value = out.pop("PYTHONPATH", None)
    if value is None:
        return out
    target = os.path.realpath(bundle)
    kept = [p for p in value.split(os.pathsep) if not p or os.path.realpath(p) != target]
    if any(kept):
        out["PYTHONPATH"] = os.pathsep.join(kept)
    return out


@dataclass(frozen=True)
class LaunchConfig:
    command: list[str]
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    termination_log: str = DEFAULT_TERMINATION_LOG
    probe: ProbeConfig | None = None  # world_size 0: one rank per GPU the backend sees
    drain_seconds: float = DRAIN_SECONDS
    judge_timeout: float = DEFAULT_JUDGE_TIMEOUT  # 0: the image's vLLM does not judge first


_ERROR_WORDS = re.compile(r"(?:Error|ERROR|error:|Exception|CUDA error)")
MAX_TEXT_DETAIL = 1024  # what parse_termination_message keeps of `detail`
_UNATTRIBUTED = "worker_prefix"  # an unparsed kind: a per-worker line whose rank is unknown


def installed_engine_version(dist: str = "vllm") -> str | None:
    """The engine's version from its package metadata. Never imports the engine: importing
    vllm would load torch and CUDA into the agent, which must stay small."""
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    # A dist-info without a Version field answers None (despite the annotation).
    return version if isinstance(version, str) and version else None


def _engine_memory(seen: WorkerMemoryReport | CudaGraphPool | InitialFree) -> EngineMemory:
    if isinstance(seen, CudaGraphPool):
        return EngineMemory(cuda_graph_bytes=seen.actual_bytes)
    if isinstance(seen, InitialFree):
        return EngineMemory(free_at_start_bytes=seen.free_bytes)
    return EngineMemory(
        consumed_bytes=seen.consumed_bytes,
        peak_activation_bytes=seen.peak_activation_bytes,
        cuda_graph_bytes=seen.cuda_graph_bytes,
        kv_in_use_bytes=seen.kv_in_use_bytes,
        free_at_start_bytes=seen.free_bytes,
        total_bytes=seen.total_bytes,
        requested_bytes=seen.requested_bytes,
        kv_to_requested_bytes=seen.kv_to_requested_bytes,
        kv_to_gpu_bytes=seen.kv_to_gpu_bytes,
    )


class Observer:
    """Keeps what the engine's lines said: the first memory cause and the phase its rank was in,
    the last KV line, and each rank's own memory report (the worker's log prefix says which rank,
    through `ranks`)."""

    def __init__(self, state: AgentState | None = None, ranks: WorkerRanks | None = None) -> None:
        self.state = state
        self.ranks = ranks if ranks is not None else WorkerRanks(ParallelSizes(), 0)
        self.cause: CudaOom | KVTooSmall | None = None
        # the global rank the cause's own line named (multi-node; one node reads the device index)
        self.cause_rank: int | None = None
        self.last_kv: KVObservation | None = None
        # every rank's engine phase (wire/phases.py): the engine core's lines speak for all ranks
        self.phases = PhaseTracker(self.ranks.rank_of)
        # the phase the cause's rank was in when it ran out (None: unknown, or not a CUDA OOM)
        self.cause_phase: str | None = None
        self._warned: set[str] = set()
        # The last few lines that look like errors: when no memory cause is recognised, they
        # are what an engine error's termination message shows a person. More than one,
        # because vLLM ends with a generic "Engine core initialization failed. See root cause
        # above." right after the line that names the cause.
        self._errors: collections.deque[str] = collections.deque(maxlen=3)

    @property
    def last_error(self) -> str | None:
        return " | ".join(self._errors) if self._errors else None

    def on_line(self, line: str) -> None:
        loading = any(fragment in line for fragment in LOAD_MARKERS)
        before = self.phases.phase(None) if loading else None
        self.phases.on_line(line)
        if loading and self.state is not None:
            if before not in (None, PHASE_WEIGHTS):
                # loading again after later phases: the engine started over, a new init snapshot
                self.state.sampler.reset_load()
            self.state.sampler.mark_load()  # free_at_load_bytes, others_at_load_bytes
        found = recognise_all(line)
        if not found:
            if _ERROR_WORDS.search(line):
                self._errors.append(line.strip()[:400])
            return
        for one in found:
            self._on(one, line)

    def _unparsed(self, kind: str, text: str) -> None:
        if self.state is not None:
            self.state.count_unparsed(kind)
        if kind not in self._warned:  # once per kind: a garbled stream must not flood the log
            self._warned.add(kind)
            log.warning("ignoring an engine line rankguard cannot read (%s): %.300s", kind, text)

    def _on(self, found: Recognised, line: str) -> None:
        if isinstance(found, Unparsed):
            self._unparsed(found.kind, found.text)
            return
        if isinstance(found, WorkerMemoryReport | CudaGraphPool | InitialFree | AfterWarmup):
            rank = self.ranks.rank_of(line)
            local = None if rank is None else self.ranks.place.local_rank(rank)
            if local is None:
                self._unparsed(_UNATTRIBUTED, found.text)
            elif self.state is not None and isinstance(found, AfterWarmup):
                self.state.warmup[local] = found.memory  # the line is whole: the latest replaces
            elif self.state is not None and not isinstance(found, AfterWarmup):
                self.state.record_engine_memory(local, _engine_memory(found))
            return
        if isinstance(found, ExtensibleDisabled):
            # said once by the engine core, for every rank: the pod's, not a rank's
            if self.state is not None:
                self.state.extensible_disabled = found.reason[:MAX_TEXT]
            log.info("the engine turned its extensible KV cache off: %.300s", found.reason)
            return
        if isinstance(found, KVObservation):
            # The workers' "Available KV cache memory" (bytes) is what the operator converts a
            # utilisation start to bytes from: the least of them, as the engine core sizes the
            # cache by its tightest worker. The token lines that follow say the same cache in
            # other units, so they do not displace it in the verdict.
            last = self.last_kv
            if (
                last is None
                or last.kind != AVAILABLE_KV
                or (found.kind == AVAILABLE_KV and found.value <= last.value)
            ):
                self.last_kv = found
            if self.state is not None:
                self.state.record_kv(found.kind, found.text, found.value)
            return
        if isinstance(found, KVTooSmall) and self.state is not None:
            value = found.needed_bytes if found.needed_bytes is not None else (found.max_seq_len or 0)
            self.state.record_kv(KV_TOO_SMALL, found.text, float(value))
        if self.cause is None or (
            # A bare "CUDA error: out of memory" is a worse witness than a message with figures.
            isinstance(self.cause, CudaOom)
            and isinstance(found, CudaOom)
            and self.cause.requested_bytes is None
            and found.requested_bytes is not None
        ):
            self.cause_rank = self._cause_rank(found, line)
            self.cause = found
            self.cause_phase = self._phase_of(found, line)
            if isinstance(found, CudaOom):
                log.warning(
                    "engine ran out of GPU memory on GPU %s (rank %s, phase %s): %.200s",
                    found.gpu_index,
                    "unknown" if self.cause_rank is None else self.cause_rank,
                    self.cause_phase or "unknown",
                    found.text,
                )
            else:
                log.warning("engine's KV cache is too small: %.200s", found.text)

    def _phase_of(self, found: CudaOom | KVTooSmall, line: str) -> str | None:
        """The phase of the rank whose line said it ran out: the line's own rank (its worker prefix,
        whose traceback precedes it), else the rank the cause names."""
        if not isinstance(found, CudaOom) or found.startup_check:
            return None  # vLLM's start-up check runs before the first phase; the utilisation answers it
        rank = self.ranks.rank_of(line)
        return self.phases.phase(rank if rank is not None else self.cause_rank)

    def _cause_rank(self, found: CudaOom | KVTooSmall, line: str) -> int | None:
        if not isinstance(found, CudaOom):
            return None
        rank = self.ranks.rank_of_oom(line, found.gpu_index)
        before, earlier = self.cause_rank, self.cause
        if rank is None and before is not None and isinstance(earlier, CudaOom):
            # A message with figures replaces a bare "CUDA error: out of memory" whose worker was
            # known; it keeps that rank unless it names another device of this pod.
            local = self.ranks.place.local_rank(before)
            if found.gpu_index is None or found.gpu_index == local:
                return before
        return rank


async def _exit_of(child: asyncio.subprocess.Process, poll: float = 0.1) -> int:
    """The child's exit status, as soon as it exits.

    Not `child.wait()`: depending on the Python version and timing, that also waits for
    the pipes to close (CPython gh-119710), and the engine's own children can hold them
    open long after it is gone.
    """
    while child.returncode is None:  # noqa: ASYNC110 - the watcher sets it; no public event exists
        await asyncio.sleep(poll)
    return child.returncode


def write_termination_log(path: str, message: TerminationMessage) -> bool:
    text = message.to_json()
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:
        log.error("cannot write the termination message to %s (%s); exit code still propagates", path, e)
        return False
    return True


class Launcher:
    def __init__(self, cfg: LaunchConfig, env: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        self.env = dict(os.environ if env is None else env)
        self.child: asyncio.subprocess.Process | None = None
        self.pending_signals: list[int] = []
        self.probe_cancel = threading.Event()
        self.runtime: AgentRuntime | None = None
        self.observer = Observer()
        self.cut_warned = False
        self.place = SINGLE_NODE
        # what the termination log holds while the engine runs: (the engine's phase, a cause seen);
        # nothing is written before either is known (the kubelet's log tail says more then)
        self.provisional: tuple[str | None, bool] = (None, False)

    def _on_cut(self, stream: str, cap: int) -> None:
        if not self.cut_warned:
            self.cut_warned = True
            log.warning(
                "engine %s: a line over %d bytes was cut for scanning (passed through whole)", stream, cap
            )

    def _scanner(self, stream: str) -> LineScanner:
        return LineScanner(self._on_line, name=stream, on_cut=self._on_cut)

    def _on_line(self, line: str) -> None:
        seen = self.observer
        seen.on_line(line)
        # Kubernetes (>= 1.28 on cgroup v2) kills the whole container on a host OOM, this launcher
        # too: whatever the termination log holds then is the message. Keep there the verdict a
        # SIGKILL now would get (the engine's phase, or the memory cause already seen), rewritten
        # when either changes; the engine's own exit overwrites it.
        now = (seen.phases.phase(None), seen.cause is not None)
        if now != self.provisional:
            self.provisional = now
            write_termination_log(self.cfg.termination_log, self._message(-signal.SIGKILL))

    def _message(self, returncode: int) -> TerminationMessage:
        seen = self.observer
        return termination_message(
            returncode,
            seen.cause,
            seen.last_kv,
            self.runtime.n_ranks() if self.runtime is not None else 1,
            last_error=seen.last_error,
            place=self.place,
            cause_rank=seen.cause_rank,
            # a CUDA OOM's rank's phase; else where the engine was (for a SIGKILL, the host OOM killer)
            phase=seen.cause_phase if seen.cause is not None else seen.phases.phase(None),
            at_load=self.runtime.sampler.at_load if self.runtime is not None else None,
        )

    def _on_signal(self, sig: int) -> None:
        child = self.child
        if child is not None and child.returncode is None:
            log.info("forwarding %s to the engine (pid %d)", signal.Signals(sig).name, child.pid)
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(sig)
        else:
            # No engine yet: remember the signal, and stop a running probe at once.
            self.pending_signals.append(sig)
            self.probe_cancel.set()

    async def run(self) -> int:
        """Run the whole launcher; returns the exit code the agent should exit with."""
        loop = asyncio.get_running_loop()
        installed = []
        for sig in FORWARDED_SIGNALS:
            try:
                loop.add_signal_handler(sig, self._on_signal, int(sig))
                installed.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                continue  # not the main thread (tests): signals stay with their default
        # The pod's processes are this one's descendants: the probe's ranks, the engine and the
        # workers it spawns (others.py); the sampler counts everyone else's memory on the GPUs.
        runtime = self.runtime = AgentRuntime(self.cfg.runtime, self.env, pod=PodProcesses(os.getpid()))
        runtime.state.engine_version = installed_engine_version()
        place = self.place = _group_place(self.cfg.command, self.env, runtime.n_ranks())
        runtime.state.place = place
        runtime.state.engine_http = engine_http(self.cfg.command, self.env, place)
        self.observer = Observer(
            runtime.state, WorkerRanks(parallel_sizes(self.cfg.command), runtime.n_ranks(), place)
        )
        try:
            if self.cfg.probe is not None:
                runtime.state.probe = await asyncio.get_running_loop().run_in_executor(
                    None, probe_pod, self.cfg.probe, runtime.n_ranks(), self.env, self.probe_cancel, place
                )
            await runtime.start()
            judged = await self._judge() if not self.pending_signals else None
            if self.pending_signals:
                # Told to stop before the engine even started: end as a killed engine would.
                first = self.pending_signals[0]
                message = with_place(
                    TerminationMessage(
                        SIGNALED, 128 + first, signal=first, detail="stopped before the engine started"
                    ),
                    place,
                )
                write_termination_log(self.cfg.termination_log, message)
                return 128 + first
            if judged is not None and judged.verdict == REFUSED:
                return self._refused(judged)
            return await self._run_child(runtime)
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            await runtime.stop()

    async def _judge(self) -> Judged:
        """The image's vLLM's verdict on the engine's argv; one line in the container log."""
        cfg = self.cfg
        env = engine_env(self.env, bundle_dir())
        try:
            judged = await asyncio.get_running_loop().run_in_executor(
                None, judge_engine_args, cfg.command, env, cfg.judge_timeout, self.probe_cancel
            )
        except Exception as e:  # the judge may only stop what vLLM refuses; its own trouble never
            judged = Judged(UNJUDGED, f"{type(e).__name__}: {e}")
        version = judged.vllm_version or "unknown"
        if judged.verdict == REFUSED:
            log.error(
                "vLLM %s refused the engine's arguments (judged in %.1f s); the engine is not started: "
                "%s\n--- what vLLM printed while judging (its end) ---\n%s",
                version,
                judged.seconds,
                judged.message,
                judged.tail.rstrip(),
            )
        elif judged.verdict == ACCEPTED:
            log.info("vLLM %s accepted the engine's arguments (judged in %.1f s)", version, judged.seconds)
        else:
            log.info(
                "vLLM %s did not judge the engine's arguments (%.1f s): %.300s; starting the engine as given",
                version,
                judged.seconds,
                judged.message,
            )
        return judged

    def _refused(self, judged: Judged) -> int:
        # the reader keeps 1 KiB of `detail`; cut here, so a long message never drops it whole
        detail = judged.message[:MAX_TEXT_DETAIL]
        message = with_place(TerminationMessage(ENGINE_REFUSED, 2, detail=detail), self.place)
        write_termination_log(self.cfg.termination_log, message)
        return message.exit_code

    async def _run_child(self, runtime: AgentRuntime) -> int:
        global engine_started
        cmd = self.cfg.command
        try:
            # A session of its own: a terminal's Ctrl-C reaches the engine once (forwarded), not twice.
            self.child = child = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=None,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=engine_env(self.env, bundle_dir()),
                start_new_session=True,
            )
        except OSError as e:
            code = 127 if isinstance(e, FileNotFoundError) else 126  # what a shell answers
            log.error("cannot start %s: %s", cmd[0] if cmd else "(nothing)", e)
            message = termination_message(
                code,
                None,
                None,
                runtime.n_ranks(),
                launch_error=f"cannot start {cmd[:1]}: {e}",
                place=self.place,
            )
            write_termination_log(self.cfg.termination_log, message)
            return code
        engine_started = True
        runtime.sampler.reset_load()  # a new engine run: its load start is still to come
        log.info("engine started (pid %d): %.300s", child.pid, " ".join(cmd))
        state = runtime.state

        def publish(found: ModelFiles) -> None:
            state.model = found.report()

        watch = ModelWatch(cmd, self.env, publish, lambda: MODEL_LOADING in state.kv_lines)
        watch.start()
        try:
            return await self._watch_child(child)
        finally:
            watch.stop(timeout=0.5)  # a read in progress must not hold up the exit

    async def _watch_child(self, child: asyncio.subprocess.Process) -> int:
        assert child.stdout is not None and child.stderr is not None
        pumps = [
            asyncio.ensure_future(pump(child.stdout, Output(1, "stdout"), self._scanner("stdout"))),
            asyncio.ensure_future(pump(child.stderr, Output(2, "stderr"), self._scanner("stderr"))),
        ]
        returncode = await _exit_of(child)
        # Grandchildren may hold the pipes open after the engine is gone; do not wait forever.
        _, stuck = await asyncio.wait(pumps, timeout=self.cfg.drain_seconds)
        for task in stuck:
            task.cancel()
        if stuck:
            log.warning("the engine's output pipes stayed open after it exited; stopped reading them")
            await asyncio.gather(*stuck, return_exceptions=True)
        message = self._message(returncode)
        log.info("engine exited with %d: %s", message.exit_code, message.reason)
        write_termination_log(self.cfg.termination_log, message)
        return message.exit_code


def _group_place(command: list[str], env: Mapping[str, str], n_ranks: int) -> GroupPlace:
    """The pod's place in its vLLM group, read from the engine's argv; said in one log line."""
    place, problem = read_group(command, env)
    if problem is not None and not place.multi_node:
        log.warning("reporting ranks as a single node: %s", problem)
    elif problem is not None:
        log.warning("%s", problem)
    if place.multi_node:
        log.info(
            "node %d of %d in a vLLM group of TP %d x PP %d%s: local ranks 0..%d are global ranks %d..%d",
            place.node_rank,
            place.nnodes,
            place.tp,
            place.pp,
            f" x PCP {place.pcp}" if place.pcp > 1 else "",
            place.local_world - 1,
            place.global_rank(0),
            place.global_rank(place.local_world - 1),
        )
        if n_ranks not in (0, place.local_world):
            log.warning(
                "the agent sees %d GPU(s) but vLLM runs %d rank(s) on each pod of the group",
                n_ranks,
                place.local_world,
            )
    return place


async def launch(cfg: LaunchConfig, env: Mapping[str, str] | None = None) -> int:
    return await Launcher(cfg, env).run()
