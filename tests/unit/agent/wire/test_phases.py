"""The engine's phase an OOM happened in, per rank: markers and traceback frames (wire/phases.py).

Every marker and OOM line is rendered from a recorded vLLM snapshot (formats.json), never typed
here, so a vLLM that rewords one fails here once its snapshot is recorded: 0.33's start-up order
(the last release sized from estimates), and the start-up of the newest release that measures its
KV cache after warm-up (0.34: load, reserve, capture & warm-up, measure, extend, serve).
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rankguard_agent.launcher import Observer
from rankguard_agent.verdict import termination_message
from rankguard_agent.wire.phases import MARKERS, PhaseTracker, frames_phase, marker_phase
from rankguard_agent.wire.recognisers import CudaOom, recognise
from rankguard_agent.wire.termination import (
    CUDA_OOM,
    PHASE_CUDA_GRAPHS,
    PHASE_KV_ALLOCATION,
    PHASE_PROFILE,
    PHASE_SAMPLER_WARMUP,
    PHASE_SERVING,
    PHASE_WEIGHTS,
    PHASES,
    TerminationError,
    TerminationMessage,
    parse_termination_message,
)
from rankguard_agent.workers import ParallelSizes, WorkerRanks
from rankguard_operator import vllm_snapshots
from rankguard_sim.fake_vllm.console import Console, failure_lines
from rankguard_sim.physics.engine_failures import CudaOutOfMemory, SamplerWarmupOOM

SNAP = vllm_snapshots.load(vllm_snapshots.ESTIMATE_SIZING_RELEASE)
MEASURED = next(
    vllm_snapshots.load(v) for v in reversed(vllm_snapshots.versions()) if vllm_snapshots.load(v).extensible
)
RELEASES = [vllm_snapshots.load(v) for v in vllm_snapshots.versions()]
GIB = 1 << 30
_PLACEHOLDER = re.compile(r"%(?:\.\d+)?([sdf])")


def messages(key: str, snap: vllm_snapshots.Snapshot = SNAP) -> list[dict[str, Any]]:
    found = snap.messages(key)
    assert found, f"the vLLM {snap.version} snapshot has no {key!r} message"
    return found


def render(msg: dict[str, Any]) -> str:
    """The template with made-up values of the types its placeholders take."""
    template = str(msg["template"])
    if msg["style"] == "percent":
        kinds = _PLACEHOLDER.findall(template.replace("%%", ""))
        return template % tuple({"s": "7", "d": 7, "f": 7.0}[k] for k in kinds)
    if msg["style"] == "format":
        return template.format(*(["7"] * len(msg["exprs"])))
    return template


def logged(msg: dict[str, Any], who: str = "Worker_TP0 pid=77") -> str:
    where = f"{Path(msg['file']).name}:{msg['line']}"
    return f"({who}) INFO 12-01 10:00:00 [{where}] {render(msg)}"


def marker(key: str, who: str = "Worker_TP0 pid=77", snap: vllm_snapshots.Snapshot = SNAP) -> str:
    return logged(messages(key, snap)[0], who)


CORE = "EngineCore_DP0 pid=9"


@pytest.mark.parametrize("snap", RELEASES, ids=lambda s: s.version)
@pytest.mark.parametrize(("key", "phase"), [(k, p) for k, _, p in MARKERS])
def test_every_recorded_marker_template_gives_its_phase(
    snap: vllm_snapshots.Snapshot, key: str, phase: str
) -> None:
    """In every recorded release: a marker it lacks is listed as absent with the reason."""
    found = snap.messages(key)
    assert found or key in snap.absent, f"vLLM {snap.version}: {key!r} is neither recorded nor absent"
    for msg in found:
        assert marker_phase(logged(msg)) == phase, msg
        assert marker_phase(render(msg)) == phase  # without vLLM's prefix too


def test_the_markers_cover_every_phase_and_only_phases() -> None:
    assert {p for _, _, p in MARKERS} == set(PHASES)
    for snap in (SNAP, MEASURED):  # each start-up order has a marker for every phase
        assert {p for k, _, p in MARKERS if snap.messages(k)} == set(PHASES), snap.version


# vLLM 0.34's start-up with its extensible KV cache, in its order (rendered from its snapshot):
# each line, who prints it, and the phase every rank is in from it on.
MEASURED_STARTUP = [
    ("model_load_start_v2", CORE, PHASE_WEIGHTS),  # load (logged once, for every rank)
    ("model_loading", "Worker_TP0 pid=77", PHASE_PROFILE),
    ("available_kv_memory", "Worker_TP0 pid=77", PHASE_KV_ALLOCATION),  # reserve the address range
    ("cuda_graph_capture_bar", "Worker_TP0 pid=77", PHASE_CUDA_GRAPHS),  # capture & warm-up
    ("cuda_graph_captured", "Worker_TP0 pid=77", PHASE_SAMPLER_WARMUP),
    ("memory_after_warmup", "Worker_TP0 pid=77", PHASE_KV_ALLOCATION),  # measured: extend next
    ("kv_cache_size", CORE, PHASE_KV_ALLOCATION),  # the minimum over ranks
    ("extensible_kv_extended", "Worker_TP0 pid=77", PHASE_KV_ALLOCATION),
    ("init_engine_took", CORE, PHASE_SERVING),  # serve
]


def test_the_measured_start_up_is_phased_in_its_order() -> None:
    assert MEASURED.extensible is not None and SNAP.extensible is None
    tracker = PhaseTracker(WorkerRanks(ParallelSizes(tp=1), 1).rank_of)
    seen = []
    for key, who, _ in MEASURED_STARTUP:
        tracker.on_line(marker(key, who, MEASURED))
        seen.append(tracker.phase(0))
    assert seen == [phase for _, _, phase in MEASURED_STARTUP]
    # the lines are the measured release's own: the estimate-sized release has none of these two
    assert {"memory_after_warmup", "extensible_kv_extended"} <= set(SNAP.absent)
    # and the V1 runner's markers it removed are absent with the reason, never silently missing
    for key in ("model_load_start", "cuda_graph_profiling", "cuda_graph_capture_untraced"):
        assert key in MEASURED.absent and MEASURED.messages(key) == []


@pytest.mark.parametrize("oom_at", range(len(MEASURED_STARTUP)))
def test_a_measured_start_up_oom_gets_the_phase_of_the_line_before_it(oom_at: int) -> None:
    lines = [marker(key, who, MEASURED) for key, who, _ in MEASURED_STARTUP[: oom_at + 1]]
    oom = f"(Worker_TP0 pid=77) ERROR 12-01 10:00:01 [x.py:1] {oom_lines()[0]}"
    seen = _observe([*lines, oom])
    assert isinstance(seen.cause, CudaOom)
    assert seen.cause_phase == MEASURED_STARTUP[oom_at][2]


def _frame(func: str, path: str = "v1/worker/gpu_worker.py") -> str:
    return f'  File "/usr/lib/python3/dist-packages/vllm/{path}", line 1, in {func}'


# What vLLM prints, in its order, up to each phase (rendered from the snapshot).
MARKERS_UP_TO = {
    PHASE_WEIGHTS: [marker("model_load_start")],
    PHASE_PROFILE: [marker("model_load_start"), marker("model_loading")],
    PHASE_KV_ALLOCATION: [
        marker("model_loading"),
        marker("available_kv_memory"),
        marker("kv_cache_size", CORE),
    ],
    PHASE_CUDA_GRAPHS: [marker("kv_cache_size", CORE), marker("cuda_graph_capture_untraced")],
    PHASE_SAMPLER_WARMUP: [marker("cuda_graph_capture_untraced"), marker("cuda_graph_captured")],
    PHASE_SERVING: [
        marker("cuda_graph_captured"),
        marker("init_engine_took", CORE),
        marker("api_server_start", "APIServer pid=1"),
    ],
}
FRAMES_OF = {
    PHASE_WEIGHTS: ["load_model", "load_model", "load_weights"],
    PHASE_PROFILE: ["determine_available_memory", "profile_run", "_dummy_run", "forward"],
    PHASE_KV_ALLOCATION: ["initialize_from_config", "initialize_kv_cache", "_allocate_kv_cache_tensors"],
    PHASE_CUDA_GRAPHS: ["compile_or_warm_up_model", "capture_model", "_capture_cudagraphs", "_dummy_run"],
    PHASE_SAMPLER_WARMUP: ["compile_or_warm_up_model", "_compile_or_warm_up_model", "_dummy_sampler_run"],
    PHASE_SERVING: ["execute_model", "execute_model", "forward"],
}


def oom_lines() -> list[str]:
    """Every OOM message torch 2.x and vLLM 0.33 print outside the start-up check, as raised."""
    tried = messages("torch_oom_tried")[0]["template"]
    capacity = "GPU 0 has a total capacity of 79.19 GiB of which 1 GiB is free."
    lines = [f"torch.OutOfMemoryError: {tried}2.00 GiB. {capacity}"]
    lines += [f"torch.OutOfMemoryError: {m['template']}2.00 GiB." for m in messages("torch_oom_fraction")]
    lines += [f"torch.OutOfMemoryError: {m['template']}" for m in messages("torch_oom_outside_allocator")]
    lines += [
        f"RuntimeError: CUDA error: {m['template']} when calling `cublasCreate(handle)`"
        for m in messages("cublas_alloc_failed")
    ]
    lines += [
        f"torch.OutOfMemoryError: Allocation on device 0{m['template']}" for m in messages("torch_oom_async")
    ]
    lines += [f"RuntimeError: {m['template']}0" for m in messages("torch_oom_on_device")]
    return lines


def _observe(lines: Sequence[str], tp: int = 1) -> Observer:
    seen = Observer(None, WorkerRanks(ParallelSizes(tp=tp), tp))
    for line in lines:
        seen.on_line(line)
    return seen


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("oom", oom_lines())
def test_every_oom_gets_the_phase_of_the_markers_before_it(phase: str, oom: str) -> None:
    seen = _observe([*MARKERS_UP_TO[phase], f"(Worker_TP0 pid=77) ERROR 12-01 10:00:01 [x.py:1] {oom}"])
    assert isinstance(seen.cause, CudaOom), oom
    assert seen.cause_phase == phase


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("oom", oom_lines())
def test_every_oom_gets_the_phase_of_its_traceback(phase: str, oom: str) -> None:
    who = "(Worker_TP1 pid=78) ERROR 12-01 10:00:01 [multiproc_executor.py:1] "
    lines = [
        who + "Traceback (most recent call last):",
        *(who + _frame(f) for f in FRAMES_OF[phase]),
        who + oom,
    ]
    seen = _observe(lines, tp=2)
    assert seen.cause_phase == phase
    message = parse_termination_message(
        termination_message(
            1, seen.cause, None, 2, cause_rank=seen.cause_rank, phase=seen.cause_phase
        ).to_json()
    )
    assert (message.reason, message.phase) == (CUDA_OOM, phase)


@pytest.mark.parametrize(
    ("frames", "phase"),
    [
        # _dummy_run is the profile's, the capture's and the warm-ups' alike: it decides nothing
        (["_compile_or_warm_up_model", "_dummy_run", "forward"], None),
        (["determine_available_memory", "profile_run", "_dummy_run"], PHASE_PROFILE),
        (["capture_model", "_capture_cudagraphs", "_warmup_and_capture", "_dummy_run"], PHASE_CUDA_GRAPHS),
        # the profile run's own sampler pass is the profile; the warm-up's is the sampler's
        (["determine_available_memory", "profile_run", "_dummy_sampler_run"], PHASE_PROFILE),
        (["compile_or_warm_up_model", "_dummy_sampler_run"], PHASE_SAMPLER_WARMUP),
        # the graphs profiled during the memory profile, on a minimal KV cache
        (["determine_available_memory", "profile_cudagraph_memory", "capture_model"], PHASE_CUDA_GRAPHS),
        (
            ["determine_available_memory", "profile_cudagraph_memory", "initialize_kv_cache"],
            PHASE_CUDA_GRAPHS,
        ),
        # execute_model inside a warm-up is not serving
        (["compile_or_warm_up_model", "warmup_kernels", "execute_model"], None),
        (["execute_model", "sample_tokens"], PHASE_SERVING),
        # vLLM 0.34: the sizing warm-up runs the largest steps through execute_model (not serving),
        # and the measured size is committed on every worker
        (
            ["compile_or_warm_up_model", "run_kv_cache_sizing_warmup", "execute_model", "forward"],
            PHASE_PROFILE,
        ),
        (["_initialize_kv_caches", "extend_kv_cache", "extend_kv_cache", "commit"], PHASE_KV_ALLOCATION),
        (["init_device", "request_memory"], None),
        ([], None),
    ],
)
def test_the_innermost_frame_that_names_a_phase_decides(frames: list[str], phase: str | None) -> None:
    assert frames_phase(frames) == phase


def test_a_traceback_beats_the_last_marker_and_dummy_run_alone_does_not() -> None:
    who = "(Worker_TP0 pid=77) ERROR 12-01 10:00:01 [multiproc_executor.py:1] "
    tb = who + "Traceback (most recent call last):"
    capture = [tb, who + _frame("capture_model", "v1/worker/gpu_model_runner.py"), who + _frame("_dummy_run")]
    oom = who + oom_lines()[0]
    # the markers say the KV cache was being allocated; the frames say the graphs were captured
    assert _observe([*MARKERS_UP_TO[PHASE_KV_ALLOCATION], *capture, oom]).cause_phase == PHASE_CUDA_GRAPHS
    # a traceback of _dummy_run alone leaves the markers' phase
    alone = [tb, who + _frame("_compile_or_warm_up_model"), who + _frame("_dummy_run")]
    assert _observe([*MARKERS_UP_TO[PHASE_KV_ALLOCATION], *alone, oom]).cause_phase == PHASE_KV_ALLOCATION
    # frames outside vLLM's source name nothing
    mine = [tb, who + '  File "/app/mine.py", line 3, in capture_model']
    assert _observe([*MARKERS_UP_TO[PHASE_PROFILE], *mine, oom]).cause_phase == PHASE_PROFILE
    # the start-up check runs before any phase, whatever was printed before
    startup = messages("startup_free_too_low")[0]
    refusal = who + "ValueError: " + str(startup["template"]).format("cuda:0", 1.5, 79.19, 0.9, 71.27)
    assert _observe([*MARKERS_UP_TO[PHASE_PROFILE], refusal]).cause_phase is None


def test_each_rank_has_its_own_phase_and_the_engine_core_speaks_for_all() -> None:
    ranks = WorkerRanks(ParallelSizes(tp=2), 2)
    phases = PhaseTracker(ranks.rank_of)
    assert (phases.phase(0), phases.phase(1), phases.phase(None)) == (None, None, None)
    phases.on_line(marker("model_load_start", "Worker_TP0 pid=77"))
    phases.on_line(marker("model_loading", "Worker_TP0 pid=77"))
    # vLLM logs these once, on its first rank: a rank that said nothing follows them
    assert (phases.phase(0), phases.phase(1)) == (PHASE_PROFILE, PHASE_PROFILE)
    phases.on_line(marker("cuda_graph_profiling", "Worker_TP1 pid=78"))
    assert (phases.phase(0), phases.phase(1)) == (PHASE_PROFILE, PHASE_CUDA_GRAPHS)
    phases.on_line(marker("kv_cache_size", CORE))
    assert (phases.phase(0), phases.phase(1), phases.phase(None)) == (PHASE_KV_ALLOCATION,) * 3
    # a traceback is its rank's only: rank 1's capture does not move rank 0
    who = "(Worker_TP1 pid=78) ERROR 12-01 10:00:01 [multiproc_executor.py:1] "
    for line in (who + "Traceback (most recent call last):", who + _frame("capture_model")):
        phases.on_line(line)
    phases.on_line("(Worker_TP0 pid=77) INFO 12-01 10:00:01 [x.py:1] an unrelated line")
    assert (phases.phase(0), phases.phase(1)) == (PHASE_KV_ALLOCATION, PHASE_CUDA_GRAPHS)
    # a newer marker of the rank ends its old traceback
    phases.on_line(marker("cuda_graph_captured", "Worker_TP1 pid=78"))
    assert phases.phase(1) == PHASE_SAMPLER_WARMUP


def test_unknown_stays_unknown() -> None:
    seen = _observe(
        [
            "(Worker_TP0 pid=77) INFO 12-01 10:00:00 [x.py:1] hello",
            f"(Worker_TP0 pid=77) ERROR {oom_lines()[0]}",
        ]
    )
    assert isinstance(seen.cause, CudaOom) and seen.cause_phase is None
    message = termination_message(1, seen.cause, None, 1, phase=seen.cause_phase)
    assert message.phase is None and '"phase":null' in message.to_json()


@pytest.mark.parametrize("phase", PHASES)
def test_the_termination_message_round_trips_the_phase(phase: str) -> None:
    oom = recognise(oom_lines()[0])
    assert isinstance(oom, CudaOom)
    message = termination_message(1, oom, None, 1, phase=phase)
    assert parse_termination_message(message.to_json()).phase == phase


def test_a_phase_outside_the_contract() -> None:
    base = TerminationMessage(CUDA_OOM, 1, rank=0)
    # a newer agent's phase this operator does not know reads as unknown
    assert parse_termination_message(TerminationMessage(CUDA_OOM, 1, phase="defrag").to_json()).phase is None
    for bad in ("7", "true", '["profile"]'):
        text = base.to_json().replace('"phase":null', f'"phase":{bad}')
        with pytest.raises(TerminationError):
            parse_termination_message(text)
    # a phase goes with a CUDA OOM, or a SIGKILL (below), only
    assert termination_message(0, None, None, 1, phase=PHASE_PROFILE).phase is None


def test_a_sigkilled_engine_says_where_it_was() -> None:
    """The host's OOM killer sends SIGKILL (the kubelet then says OOMKilled): the message carries
    the engine's phase then, so the operator can say whether it struck while the weights were
    staged or while serving. A SIGTERM (a roll) carries none."""
    seen = _observe([marker("model_load_start", CORE)])
    assert seen.phases.phase(None) == PHASE_WEIGHTS
    killed = termination_message(-9, None, None, 1, phase=seen.phases.phase(None))
    assert (killed.reason, killed.signal, killed.phase) == ("Signaled", 9, PHASE_WEIGHTS)
    assert parse_termination_message(killed.to_json()).phase == PHASE_WEIGHTS
    assert termination_message(-15, None, None, 1, phase=PHASE_WEIGHTS).phase is None


# The fake vLLM: its phase names (sim/rankguard_sim/physics) and what the agent must read them as.
SIM_PHASES = {
    "load-model": PHASE_WEIGHTS,
    "profile-run": PHASE_PROFILE,
    "initialize-kv-cache": PHASE_KV_ALLOCATION,
    "capture-cuda-graphs": PHASE_CUDA_GRAPHS,
    "sampler-warmup": PHASE_SAMPLER_WARMUP,
    "execute-model": PHASE_SERVING,
}


@pytest.mark.parametrize(("sim_phase", "phase"), SIM_PHASES.items())
@pytest.mark.parametrize("with_markers", [True, False])
def test_a_fake_oom_in_each_phase_is_read_as_that_phase(
    sim_phase: str, phase: str, with_markers: bool
) -> None:
    failure: CudaOutOfMemory = CudaOutOfMemory(
        1,
        sim_phase,
        nbytes=2 * GIB,
        free=GIB,
        total=80 * GIB,
        process_bytes=79 * GIB,
        torch_allocated=70 * GIB,
        private_pools=0,
    )
    if sim_phase == "sampler-warmup":  # vLLM wraps it in its advice, a second traceback
        failure = SamplerWarmupOOM(failure, 256)
    out, err = io.StringIO(), io.StringIO()
    console = Console(78, out, err)
    console.error_lines(
        "Worker_TP1", "multiproc_executor.py:671", ["WorkerProc hit an exception.", *failure_lines(failure)]
    )
    lines = err.getvalue().splitlines()
    if with_markers:
        lines = [*MARKERS_UP_TO[phase], *lines]
    seen = _observe(lines, tp=2)
    assert isinstance(seen.cause, CudaOom)
    assert (seen.cause_rank, seen.cause_phase) == (1, phase)
