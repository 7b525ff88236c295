"""What the fake vLLM prints: vLLM's log-line prefixes, worker names and failure tracebacks.

The agent and the kubelet read these lines as they would read real vLLM's. vLLM's own
messages are rendered from the recorded vLLM 0.33.0 snapshot (`vllm_snapshot`); the traceback
frames below are illustrative: the start-up refusals' frames point at vLLM 0.33.0's source
lines, the others keep older line numbers (nothing reads them).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from rankguard_sim.physics.engine_failures import (
    CudaOutOfMemory,
    EngineFailure,
    GpuLost,
    NoKVCacheMemory,
    SamplerWarmupOOM,
)
from rankguard_sim.physics.engine_memory import TAG_SERVING_COMM
from rankguard_sim.physics.scenario_data import Scenario
from rankguard_sim.vllm_snapshot import snapshot

ENGINE_INIT_FAILED = (
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"
)
ENGINE_DEAD = (
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. "
    "See stack trace (above) for the root cause."
)
VLLM_PKG = "/usr/local/lib/python3.12/dist-packages/vllm"
# vLLM 0.33's V1 model runner, whose lines the fake prints (the snapshot also has the V2 runner's)
RUNNER = "gpu_model_runner.py"

# Where each phase's allocation happens in vLLM, for the traceback (file, line, function, code).
Frame = tuple[str, int, str, str]
_FRAMES: dict[str, list[Frame]] = {
    "init-device": [
        (
            "v1/worker/gpu_worker.py",
            214,
            "init_device",
            "init_worker_distributed_environment(self.vllm_config, self.rank,",
        ),
        (
            "distributed/parallel_state.py",
            1187,
            "init_distributed_environment",
            "_WORLD = init_world_group(ranks, local_rank, backend)",
        ),
    ],
    "load-model": [
        (
            "v1/worker/gpu_worker.py",
            271,
            "load_model",
            "self.model_runner.load_model(eep_scale_up=eep_scale_up)",
        ),
        ("v1/worker/gpu_model_runner.py", 2635, "load_model", "self.model = model_loader.load_model("),
        (
            "model_executor/model_loader/base_loader.py",
            49,
            "load_model",
            "model = initialize_model(vllm_config=vllm_config,",
        ),
    ],
    "profile-run": [
        ("v1/worker/gpu_worker.py", 301, "determine_available_memory", "self.model_runner.profile_run()"),
        (
            "v1/worker/gpu_model_runner.py",
            3410,
            "profile_run",
            "hidden_states, last_hidden_states = self._dummy_run(",
        ),
        (
            "model_executor/models/llama.py",
            409,
            "forward",
            "hidden_states, residual = layer(positions, hidden_states, residual)",
        ),
    ],
    "initialize-kv-cache": [
        (
            "v1/worker/gpu_worker.py",
            352,
            "initialize_from_config",
            "self.model_runner.initialize_kv_cache(kv_cache_config)",
        ),
        (
            "v1/worker/gpu_model_runner.py",
            4013,
            "_allocate_kv_cache_tensors",
            "tensor = torch.zeros(kv_cache_tensor.size, dtype=torch.int8,",
        ),
    ],
    "capture-cuda-graphs": [
        (
            "v1/worker/gpu_worker.py",
            390,
            "compile_or_warm_up_model",
            "cuda_graph_memory_bytes = self.model_runner.capture_model()",
        ),
        (
            "v1/worker/gpu_model_runner.py",
            3590,
            "capture_model",
            "self._capture_cudagraphs(compilation_cases,",
        ),
    ],
    "sampler-warmup": [
        ("v1/worker/gpu_worker.py", 420, "compile_or_warm_up_model", "self.model_runner._dummy_sampler_run("),
        (
            "v1/worker/gpu_model_runner.py",
            3297,
            "_dummy_sampler_run",
            "sampler_output = self.sampler(logits=logits,",
        ),
    ],
    "execute-model": [
        (
            "v1/worker/gpu_worker.py",
            476,
            "execute_model",
            "output = self.model_runner.execute_model(scheduler_output,",
        ),
        (
            "v1/worker/gpu_model_runner.py",
            2239,
            "execute_model",
            "logits = self.model.compute_logits(sample_hidden_states)",
        ),
        ("model_executor/layers/logits_processor.py", 70, "forward", "logits = self._gather_logits(logits)"),
    ],
}
_COMM_FRAMES: list[Frame] = [
    ("v1/worker/gpu_worker.py", 463, "execute_model", "get_pp_group().recv_tensor_dict("),
    (
        "distributed/parallel_state.py",
        830,
        "recv_tensor_dict",
        "torch.distributed.recv(tensor, src=self.ranks[src], group=group)",
    ),
]


# ---------------------------------------------------------------------------------------------
# Console: vLLM's log prefixes


class Console:
    """vLLM-style lines: "(Worker_TP1 pid=77) INFO 10-02 12:00:00 [gpu_worker.py:298] ..."."""

    def __init__(self, pid: int, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.pid = pid
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    @staticmethod
    def stamp() -> str:
        return time.strftime("%m-%d %H:%M:%S")

    def line(self, who: str, level: str, where: str, msg: str, *, stream: TextIO | None = None) -> None:
        target = stream or (self.err if level in ("ERROR", "CRITICAL") else self.out)
        target.write(f"({who} pid={self.pid}) {level} {self.stamp()} [{where}] {msg}\n")
        target.flush()

    def info(self, who: str, where: str, msg: str) -> None:
        self.line(who, "INFO", where, msg)

    def warning(self, who: str, where: str, msg: str) -> None:
        self.line(who, "WARNING", where, msg)

    def error_lines(self, who: str, where: str, lines: Sequence[str]) -> None:
        for text in lines:
            self.line(who, "ERROR", where, text)

    def plain(self, msg: str, *, error: bool = False) -> None:
        target = self.err if error else self.out
        target.write(msg + "\n")
        target.flush()

    def bare(self, level: str, where: str, msg: str) -> None:
        """A line of a process vLLM does not decorate (a headless node's main process)."""
        self.plain(f"{level} {self.stamp()} [{where}] {msg}", error=level in ("ERROR", "CRITICAL"))

    def engine_failed_to_start(self, lines: Sequence[str]) -> None:
        """The engine core's report when its executor could not start (`lines`: the cause)."""
        self.error_lines("EngineCore_DP0", "core.py:779", ["EngineCore failed to start.", *lines])
        self.plain(ENGINE_INIT_FAILED, error=True)

    def engine_died(self, error: str) -> None:
        """The engine core's fatal error while serving (`error`: its last line), then the API
        server's end."""
        self.error_lines("EngineCore_DP0", "core.py:710", ["EngineCore encountered a fatal error.", error])
        self.error_lines("APIServer", "async_llm.py:480", ["AsyncLLM output_handler failed.", ENGINE_DEAD])
        self.plain("INFO:     Shutting down")
        self.plain(f"INFO:     Finished server process [{self.pid}]")


def init_engine_line(seconds: float) -> tuple[str, str]:
    """([file:line], text) of the engine core's "init engine ... took" line, the end of start-up.
    vLLM 0.33 has three (with the compilation's and the encoder's times when they are non-zero);
    the fake compiles nothing, so it is the one with the fewest figures."""
    entry = min(snapshot().messages("init_engine_took"), key=lambda e: str(e["template"]).count("%"))
    return f"{str(entry['file']).rsplit('/', 1)[-1]}:{entry['line']}", str(entry["template"]) % (seconds,)


def worker_name(scenario: Scenario, rank: int) -> str:
    """vLLM names worker processes by their parallel ranks; one GPU runs inside the engine core."""
    if scenario.world_size == 1:
        return "EngineCore_DP0"
    if scenario.pipeline_parallel_size > 1:
        return f"Worker_PP{scenario.pp_rank(rank)}_TP{scenario.tp_rank(rank)}"
    return f"Worker_TP{rank}"


def traceback_lines(frames: Sequence[Frame], final: str) -> list[str]:
    lines = ["Traceback (most recent call last):"]
    for path, lineno, func, code in frames:
        lines.append(f'  File "{VLLM_PKG}/{path}", line {lineno}, in {func}')
        lines.append(f"    {code}")
    lines.append(final)
    return lines


def failure_lines(failure: EngineFailure) -> list[str]:
    """The worker's traceback for a failure, ending with the exception line(s)."""
    if isinstance(failure, CudaOutOfMemory):
        frames = _COMM_FRAMES if failure.what == TAG_SERVING_COMM else _FRAMES.get(failure.phase, [])
        lines = traceback_lines(frames, f"torch.OutOfMemoryError: {failure.message()}")
        if isinstance(failure, SamplerWarmupOOM):
            lines += ["", "The above exception was the direct cause of the following exception:", ""]
            lines += traceback_lines(_FRAMES["sampler-warmup"][:1], f"RuntimeError: {failure.advice()}")
        return lines
    kv_raise = 57 if isinstance(failure, NoKVCacheMemory) else 77
    frames = {
        "init-device": [
            ("v1/worker/gpu_worker.py", 542, "init_device", "self.requested_memory = request_memory("),
            ("v1/worker/utils.py", 762, "request_memory", "raise ValueError("),
        ],
        "kv-cache": [
            (
                "v1/engine/core.py",
                321,
                "_initialize_kv_caches",
                "kv_cache_configs = get_kv_cache_configs(",
            ),
            ("v1/core/kv_cache_planning.py", 1554, "get_kv_cache_configs", "_check_enough_kv_cache_memory("),
            ("v1/core/kv_cache_planning.py", kv_raise, "_check_enough_kv_cache_memory", "raise ValueError("),
        ],
    }.get(failure.phase, _FRAMES.get(failure.phase, []))
    kind = "RuntimeError" if isinstance(failure, GpuLost) else "ValueError"
    return traceback_lines(frames, f"{kind}: {failure.message()}")
