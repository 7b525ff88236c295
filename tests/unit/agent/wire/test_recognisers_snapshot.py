"""The log recognisers on every message of the recorded vLLM snapshot.

The lines are rendered from the snapshot's templates (read out of the real package by
hack/vllm-snapshot/snapshot.py), never typed by hand, so a vLLM that rewords a message fails
here as soon as its snapshot is recorded. The hand-collected real lines of PyTorch and older
vLLMs are in test_recognisers.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rankguard_agent.launcher import Observer
from rankguard_agent.verdict import termination_message
from rankguard_agent.wire.recognisers import (
    AVAILABLE_KV,
    CUDA_GRAPH_POOL,
    GIB,
    INITIAL_FREE,
    KV_TOKENS,
    MAX_CONCURRENCY,
    MODEL_LOADING,
    WORKER_MEMORY_REPORT,
    CudaGraphPool,
    CudaOom,
    InitialFree,
    KVObservation,
    KVTooSmall,
    Unparsed,
    WorkerMemoryReport,
    recognise,
    recognise_all,
)
from rankguard_agent.wire.termination import CUDA_OOM, parse_termination_message
from rankguard_operator import vllm_snapshots
from tests.unit.agent.wire.printed_sizes import g, pytorch_format

MIB = 1 << 20
KIB = 1 << 10


SNAP = vllm_snapshots.latest()


def format_gib(b: int) -> float:
    """vLLM's format_gib: GiB rounded to 2 decimals (printed with %s / {} as Python prints floats)."""
    return round(b / GIB, 2)


# vLLM 0.34 ends its KV refusals with a hint of its own making (`_more_kv_cache_memory_hint`, a
# trailing field the older releases' templates wrote out): a sample of it, where a template has one.
HINT = "Try increasing `gpu_memory_utilization` when initializing the engine."


def render(msg: dict[str, Any], values: Sequence[object]) -> str:
    if msg["style"] == "format" and msg["exprs"] and msg["exprs"][-1] == "hint":
        values = (*values, HINT)
    if msg["style"] == "percent":
        return str(msg["template"]) % tuple(values)
    if msg["style"] == "format":
        return str(msg["template"]).format(*values)
    assert msg["style"] == "plain" and not values, msg
    return str(msg["template"])


def logged(msg: dict[str, Any], text: str, who: str = "Worker_TP1 pid=77", level: str = "INFO") -> str:
    """The rendered message as vLLM's logger prints it, with the worker prefix."""
    where = f"{Path(msg['file']).name}:{msg['line']}"
    return f"({who}) {level} 12-01 10:00:00 [{where}] {text}"


def messages(key: str) -> list[dict[str, Any]]:
    found = SNAP.messages(key)
    assert found, f"the snapshot has no {key!r} message"
    return found


@pytest.mark.parametrize("msg", messages("kv_cache_size"), ids=lambda m: f"{m['file']}:{m['line']}")
def test_one_line_kv_size_gives_tokens_and_concurrency(msg: dict[str, Any]) -> None:
    for device, tokens, per_request, factor in (("GPU", 1234560, 8192, 150.7), ("CPU", 960, 131072, 0.01)):
        line = logged(
            msg, render(msg, (device, f"{tokens:,}", f"{per_request:,}", factor)), "EngineCore_DP0 pid=9"
        )
        found = recognise_all(line)
        kv = {f.kind: f.value for f in found if isinstance(f, KVObservation)}
        assert kv == {KV_TOKENS: tokens, MAX_CONCURRENCY: pytest.approx(factor)}, line
        assert len(found) == 2
        # `recognise` keeps answering the first thing a line says
        first = recognise(line)
        assert isinstance(first, KVObservation) and first.kind == KV_TOKENS


def test_older_two_line_kv_forms_still_give_one_each() -> None:
    tokens = recognise_all("INFO [kv_cache_utils.py:1087] GPU KV cache size: 1,234,560 tokens")
    conc = recognise_all(
        "INFO [kv_cache_utils.py:1091] Maximum concurrency for 8,192 tokens per request: 150.70x"
    )
    assert [(f.kind, f.value) for f in tokens if isinstance(f, KVObservation)] == [(KV_TOKENS, 1234560)]
    assert [(f.kind, f.value) for f in conc if isinstance(f, KVObservation)] == [(MAX_CONCURRENCY, 150.70)]


@pytest.mark.parametrize(
    ("key", "values", "kind", "expected"),
    [
        ("available_kv_memory", (format_gib(g(23.45)),), AVAILABLE_KV, g(23.45)),
        ("available_kv_memory", (format_gib(0),), AVAILABLE_KV, 0),
        ("model_loading", (format_gib(g(14.99)), 5.123456), MODEL_LOADING, g(14.99)),
    ],
)
def test_snapshot_kv_lines(key: str, values: tuple[object, ...], kind: str, expected: int) -> None:
    for msg in messages(key):
        found = recognise_all(logged(msg, render(msg, values)))
        assert [(f.kind, f.value) for f in found if isinstance(f, KVObservation)] == [(kind, expected)]


@pytest.mark.parametrize("msg", messages("kv_too_small"), ids=lambda m: f"{m['file']}:{m['line']}")
def test_snapshot_kv_too_small(msg: dict[str, Any]) -> None:
    for estimated in ("", "Based on the available memory, the estimated maximum model length is 77824. "):
        text = render(msg, (131072, format_gib(16 * GIB), format_gib(g(9.5)), estimated))
        found = recognise(logged(msg, f"ValueError: {text}", "EngineCore_DP0 pid=9", "ERROR"))
        assert isinstance(found, KVTooSmall)
        assert (found.max_seq_len, found.needed_bytes, found.available_bytes) == (131072, 16 * GIB, g(9.5))


def test_snapshot_no_kv_memory() -> None:
    for msg in messages("no_kv_memory"):
        found = recognise(logged(msg, f"ValueError: {render(msg, ())}", "EngineCore_DP0 pid=9", "ERROR"))
        assert isinstance(found, KVTooSmall) and found.available_bytes == 0


@pytest.mark.parametrize("key", ["startup_free_too_low", "startup_free_external"])
@pytest.mark.parametrize("device", ["cuda:3", "cuda:0"])
def test_snapshot_startup_refusals_are_cuda_ooms_on_their_device(key: str, device: str) -> None:
    free, total, budget = g(1.5), g(79.19), g(71.27)
    for msg in messages(key):
        text = render(msg, (device, format_gib(free), format_gib(total), 0.9, format_gib(budget)))
        oom = recognise(logged(msg, f"ValueError: {text}", "Worker_TP3 pid=80", "ERROR"))
        assert isinstance(oom, CudaOom), text
        assert oom.startup_check and oom.external_weight_bytes is None
        assert (oom.gpu_index, oom.free_bytes, oom.total_bytes, oom.requested_bytes) == (
            int(device.split(":")[1]),
            free,
            total,
            budget,
        )


@pytest.mark.parametrize("device", ["cuda:3", "cuda:0"])
@pytest.mark.parametrize(
    ("weights", "total", "util"),
    [(g(75.0), g(79.19), 0.9), (g(40.12), g(79.19), 0.5), (g(22.0), g(23.55), 0.92)],
)
def test_snapshot_external_weights_refusal_is_a_startup_oom_with_the_weights(
    device: str, weights: int, total: int, util: float
) -> None:
    """vLLM 0.33's third refusal in request_memory: weights another process holds on the GPU
    reach total x utilisation. No KV was allocated and no free figure is printed; the weights
    are carried so the operator raises the utilisation instead of shrinking the budget."""
    requested = math.ceil(total * util)  # vLLM's requested_memory
    for msg in messages("startup_external_weights"):
        values = (device, format_gib(weights), format_gib(total), util, format_gib(requested))
        text = render(msg, values)
        line = logged(msg, f"ValueError: {text}", "Worker_TP3 pid=80", "ERROR")
        found = recognise_all(line)
        assert len(found) == 1, found
        oom = found[0]
        assert isinstance(oom, CudaOom), text
        assert oom.startup_check and oom.free_bytes is None
        assert oom.gpu_index == int(device.split(":")[1])
        assert _near(oom.total_bytes or 0, total) and _near(oom.requested_bytes or 0, requested)
        assert oom.external_weight_bytes is not None and _near(oom.external_weight_bytes, weights)
        # the termination message carries it to the operator
        tm = parse_termination_message(termination_message(1, oom, None, 4).to_json())
        assert (tm.reason, tm.rank, tm.startup_check) == (CUDA_OOM, oom.gpu_index, True)
        assert tm.external_weight_bytes == oom.external_weight_bytes and tm.free_bytes is None


def test_snapshot_external_weights_refusal_cut_before_its_figures_is_no_oom() -> None:
    for msg in messages("startup_external_weights"):
        line = logged(msg, render(msg, ("cuda:1", 75.0, 79.19, 0.9, 71.28)), "Worker_TP1 pid=77", "ERROR")
        cut = line[: line.index(" GiB)")]
        assert not any(isinstance(f, CudaOom) for f in recognise_all(cut)), cut


def _torch_size(size: int) -> str:
    return pytorch_format(size)


def test_snapshot_torch_oom_fraction_is_an_oom_with_the_requested_size() -> None:
    for msg in messages("torch_oom_fraction"):
        for size in (2 * GIB, 512, 20 * MIB):
            # The fragment is the start of torch's message; torch appends the size and more text.
            line = f"torch.OutOfMemoryError: {msg['template']}{_torch_size(size)}. Device limit: 40.00 GiB."
            oom = recognise(logged(msg, line, "Worker_TP0 pid=76", "ERROR"))
            assert isinstance(oom, CudaOom)
            assert oom.requested_bytes == size


def test_snapshot_torch_oom_outside_the_allocator_is_an_oom() -> None:
    for msg in messages("torch_oom_outside_allocator"):
        oom = recognise(
            f"(Worker_TP1 pid=77) ERROR 12-01 10:00:00 [x.py:1] torch.OutOfMemoryError: {msg['template']}"
        )
        assert isinstance(oom, CudaOom)
        assert oom.requested_bytes is None and oom.gpu_index is None


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # torch's TORCH_CUDABLAS_CHECK, as a traceback ends (vllm-project/vllm#8180: "RuntimeError:
        # CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`" serving w8a8)
        ("RuntimeError: CUDA error: ", " when calling `cublasCreate(handle)`"),
        # as vLLM's multiprocessing executor reports a worker's exception
        (
            "(EngineCore_DP0 pid=9) ERROR 12-01 10:00:00 [core.py:1] RuntimeError: Worker failed with "
            "error 'CUDA error: ",
            " when calling `cublasLtMatmul(ltHandle, computeDesc.descriptor(), ...)`'",
        ),
    ],
)
def test_snapshot_cublas_alloc_failed_is_an_oom_without_figures(before: str, after: str) -> None:
    """cuBLAS could not allocate its handle or workspace: the GPU is full, and the message names
    neither a size nor a GPU, like "CUDA error: out of memory"."""
    for msg in messages("cublas_alloc_failed"):
        frag = msg["template"]
        found = recognise_all(f"{before}{frag}{after}")
        assert len(found) == 1
        oom = found[0]
        assert isinstance(oom, CudaOom) and not oom.startup_check
        assert (oom.gpu_index, oom.requested_bytes, oom.free_bytes, oom.total_bytes) == (None,) * 4
        # another cuBLAS status is not a memory failure
        assert recognise_all(f"{before}{frag.replace('ALLOC_FAILED', 'NOT_SUPPORTED')}{after}") == []


def test_a_later_oom_with_figures_replaces_a_cublas_alloc_failure() -> None:
    """The launcher keeps the first memory cause, unless a later one has figures."""
    cublas = f"RuntimeError: CUDA error: {messages('cublas_alloc_failed')[0]['template']}"
    tried = messages("torch_oom_tried")[0]["template"]
    lines = Observer()
    lines.on_line(f"(Worker_TP1 pid=77) ERROR 12-01 10:00:00 [x.py:1] {cublas}")
    first = lines.cause
    assert isinstance(first, CudaOom) and first.requested_bytes is None
    lines.on_line(
        f"(Worker_TP1 pid=77) ERROR 12-01 10:00:01 [x.py:1] torch.OutOfMemoryError: {tried}2.00 GiB."
    )
    assert isinstance(lines.cause, CudaOom) and lines.cause.requested_bytes == 2 * GIB


def test_snapshot_torch_oom_fragments_compose_the_allocator_message() -> None:
    tried = messages("torch_oom_tried")[0]["template"]
    capacity = messages("torch_oom_capacity")[0]["template"]
    # The second recorded private-pools string is a strings(1) artefact of the .so (a symbol name
    # glued to it), not a message; the first one is what torch prints.
    pools = messages("torch_oom_private_pools")[0]["template"]
    line = (
        f"torch.OutOfMemoryError: {tried}2.00 GiB. GPU 1{capacity}79.19 GiB of which 1.06 GiB is free. "
        f"Of the allocated memory 60.50 GiB is allocated by PyTorch, with 3.25 GiB{pools}and 1.25 GiB is "
        "reserved by PyTorch but unallocated."
    )
    oom = recognise(line)
    assert isinstance(oom, CudaOom)
    assert (oom.gpu_index, oom.requested_bytes, oom.total_bytes, oom.free_bytes) == (
        1,
        2 * GIB,
        g(79.19),
        g(1.06),
    )
    assert (oom.private_pool_bytes, oom.reserved_unallocated_bytes) == (g(3.25), g(1.25))
    huge = recognise(f"torch.OutOfMemoryError: {messages('torch_oom_tried')[1]['template']}")
    assert isinstance(huge, CudaOom) and huge.requested_bytes is None


# A worker's figures: (free, total, util, requested, consumed, peak, graphs, kv→requested, kv→gpu, kv now)
WORKER_FIGURES = [
    (g(78.5), g(79.19), 0.9, g(71.27), g(16.2), g(3.1), g(0.45), 54_443_114_291, 60_900_111_222, g(40.0)),
    (g(23.1), g(23.55), 0.8, g(18.84), g(9.9), g(1.25), 0, 8_160_000_000, 12_300_000_000, g(7.5)),
    (g(10.0), g(23.55), 0.9, g(21.2), g(20.0), g(1.5), g(0.3), -1_800_000_000, 0, 0),
]


def _worker_report(msg: dict[str, Any], f: tuple[Any, ...], who: str = "Worker_TP1 pid=77") -> str:
    free, total, util, requested, consumed, peak, graphs, to_req, to_gpu, now = f
    values = (
        format_gib(free),
        format_gib(total),
        util,
        format_gib(requested),
        format_gib(consumed),
        format_gib(peak),
        format_gib(graphs),
        to_req,
        format_gib(to_req),
        to_gpu,
        format_gib(to_gpu),
        format_gib(now),
    )
    return logged(msg, render(msg, values), who)


def _near(printed: int, exact: int) -> bool:
    """Within format_gib's rounding (0.005 GiB)."""
    return abs(printed - exact) <= GIB // 200 + 1


@pytest.mark.parametrize("figures", WORKER_FIGURES)
def test_snapshot_worker_memory_report(figures: tuple[Any, ...]) -> None:
    free, total, util, requested, consumed, peak, graphs, to_req, to_gpu, now = figures
    for msg in messages("worker_memory_report"):
        found = recognise_all(_worker_report(msg, figures))
        assert len(found) == 1
        rep = found[0]
        assert isinstance(rep, WorkerMemoryReport)
        assert rep.kv_to_requested_bytes == to_req and rep.kv_to_gpu_bytes == to_gpu  # exact
        assert rep.gpu_memory_utilization == util
        for got, want in (
            (rep.free_bytes, free),
            (rep.total_bytes, total),
            (rep.requested_bytes, requested),
            (rep.consumed_bytes, consumed),
            (rep.peak_activation_bytes, peak),
            (rep.cuda_graph_bytes, graphs),
            (rep.kv_in_use_bytes, now),
        ):
            assert _near(got, want), (got, want)
        assert recognise(_worker_report(msg, figures)) == rep


def test_a_truncated_worker_report_is_counted_never_a_value() -> None:
    for msg in messages("worker_memory_report"):
        line = _worker_report(msg, WORKER_FIGURES[0])
        start = line.index("Free memory on device")
        # Every cut that loses a figure or its unit (the final "." alone carries nothing).
        for n in range(start, len(line) - 1):
            found = recognise_all(line[:n])
            assert not any(isinstance(f, WorkerMemoryReport | CudaOom) for f in found), line[:n]
            if "Desired GPU memory utilization is" in line[:n]:
                assert found == [Unparsed(WORKER_MEMORY_REPORT, line[:n].strip())], line[:n]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("`--kv-cache-memory=54443114291`", "`--kv-cache-memory=5444311429`"),  # a digit lost
        ("`--kv-cache-memory=60900111222`", "`--kv-cache-memory=60900111222.5`"),
        ("78.5/79.19 GiB", "79.19/78.5 GiB"),  # free above total
        ("(0.9, ", "(9.0, "),  # no utilisation above 1
        ("16.2 GiB for consumed", "16.2 TiB for consumed"),
        ("3.1 GiB for peak activation", "nan GiB for peak activation"),
        ("for CUDAGraph memory", "for graph memory"),  # a future wording without the figure's anchor
        ("Current kv cache memory in use is 40.0 GiB", "Current kv cache memory in use is  GiB"),
    ],
)
def test_a_garbled_worker_report_is_counted_never_a_value(old: str, new: str) -> None:
    for msg in messages("worker_memory_report"):
        line = _worker_report(msg, WORKER_FIGURES[0])
        assert old in line
        bad = line.replace(old, new)
        assert recognise_all(bad) == [Unparsed(WORKER_MEMORY_REPORT, bad.strip())]


def test_snapshot_cuda_graph_pool_line() -> None:
    for msg in messages("cuda_graph_pool"):
        actual, estimated = g(0.45), g(0.5)
        diff = format_gib(actual - estimated)
        line = logged(
            msg, render(msg, (format_gib(actual), format_gib(estimated), diff, -10.0)), "Worker_TP2 pid=78"
        )
        found = recognise_all(line)
        assert len(found) == 1 and isinstance(found[0], CudaGraphPool)
        assert _near(found[0].actual_bytes, actual)
        assert found[0].estimated_bytes is not None and _near(found[0].estimated_bytes, estimated)
        cut = line[: line.index("(actual)") - 3]
        assert recognise_all(cut) == [Unparsed(CUDA_GRAPH_POOL, cut.strip())]


def test_snapshot_initial_free_line_of_a_byte_budget_start() -> None:
    """With --kv-cache-memory-bytes vLLM prints no memory report, but this line, per worker:
    the free memory its start-up check compared with."""
    for msg in messages("kv_bytes_reserved"):
        free, reserved = g(20.64), g(11.7)
        line = logged(msg, render(msg, (format_gib(free), format_gib(reserved))), "Worker_TP1 pid=78")
        found = recognise_all(line)
        assert len(found) == 1 and isinstance(found[0], InitialFree), found
        assert _near(found[0].free_bytes, free) and _near(found[0].reserved_bytes, reserved)
        cut = line[: line.index(" GiB, reserved")] + " [truncated] " + line[line.index("memory for KV") :]
        assert recognise_all(cut) == [Unparsed(INITIAL_FREE, cut.strip())]
