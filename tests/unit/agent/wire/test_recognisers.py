"""The log recognisers on the real message formats of PyTorch and vLLM, and their variants."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_agent.wire.recognisers import (
    AVAILABLE_KV,
    GIB,
    KV_TOKENS,
    MAX_CONCURRENCY,
    MODEL_LOADING,
    CudaOom,
    KVObservation,
    KVTooSmall,
    parse_size,
    recognise,
)
from tests.unit.agent.wire.printed_sizes import g, pytorch_format

MIB = 1 << 20
KIB = 1 << 10

# PyTorch >= 2.1 (c10/cuda/CUDACachingAllocator.cpp), as vLLM workers print it.
NEW_OOM = (
    "(Worker_TP1 pid=77) ERROR 10-02 12:00:01 [multiproc_executor.py:596] torch.OutOfMemoryError: "
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which "
    "1.06 GiB is free. Process 4242 has 12.00 GiB memory in use. Including non-PyTorch memory, this "
    "process has 66.12 GiB memory in use. Of the allocated memory 60.50 GiB is allocated by PyTorch, "
    "with 3.25 GiB allocated in private pools (e.g., CUDA Graphs), and 1.25 GiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
    "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

OLD_OOM = (
    "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; "
    "14.56 GiB already allocated; 10.81 MiB free; 14.60 GiB reserved in total by PyTorch) If reserved "
    "memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation."
)


@pytest.mark.parametrize(
    ("number", "unit", "expected"),
    [
        ("512", "bytes", 512),
        ("1", "B", 1),
        ("1024", "byte", 1024),
        ("1.50", "KiB", 1536),
        ("20.00", "MiB", 20 * MIB),
        ("2.00", "GiB", 2 * GIB),
        ("79.19", "GiB", g(79.19)),
        ("1.5", "GB", 1_500_000_000),
        ("1,024.00", "MiB", 1024 * MIB),
    ],
)
def test_parse_size_units(number: str, unit: str, expected: int) -> None:
    assert parse_size(number, unit) == expected


def test_new_format_oom_with_every_clause() -> None:
    oom = recognise(NEW_OOM)
    assert isinstance(oom, CudaOom)
    assert oom.gpu_index == 1
    assert oom.requested_bytes == 2 * GIB
    assert oom.total_bytes == g(79.19)
    assert oom.free_bytes == g(1.06)
    assert oom.other_processes == ((4242, 12 * GIB),)
    assert oom.this_process_bytes == g(66.12)
    assert oom.allocated_bytes == g(60.50)
    assert oom.private_pool_bytes == g(3.25)
    assert oom.reserved_unallocated_bytes == g(1.25)
    assert not oom.startup_check


def test_other_process_clauses_come_first_and_repeat() -> None:
    line = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512 bytes. GPU 3 has a total "
        "capacity of 23.65 GiB of which 640.00 KiB is free. Process 11 has 10.00 GiB memory in use. "
        "Process 12 has 13.50 GiB memory in use. Of the allocated memory 9.00 GiB is allocated by "
        "PyTorch, and 100.00 MiB is reserved by PyTorch but unallocated."
    )
    oom = recognise(line)
    assert isinstance(oom, CudaOom)
    assert (oom.gpu_index, oom.requested_bytes, oom.free_bytes) == (3, 512, 640 * KIB)
    assert oom.other_processes == ((11, 10 * GIB), (12, round(13.5 * GIB)))
    assert oom.this_process_bytes is None
    assert oom.private_pool_bytes is None
    assert oom.reserved_unallocated_bytes == 100 * MIB


def test_allowed_clause_from_a_memory_fraction_does_not_hide_figures() -> None:
    line = (
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 KiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 5.00 GiB is free. Including non-PyTorch memory, this process has "
        "40.00 GiB memory in use. 40.00 GiB allowed; Of the allocated memory 39.00 GiB is allocated by "
        "PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
    )
    oom = recognise(line)
    assert isinstance(oom, CudaOom)
    assert (oom.requested_bytes, oom.free_bytes, oom.this_process_bytes) == (1024, 5 * GIB, 40 * GIB)
    assert oom.reserved_unallocated_bytes == 0


def test_old_format_oom_before_pytorch_2_1() -> None:
    oom = recognise(OLD_OOM)
    assert isinstance(oom, CudaOom)
    assert oom.gpu_index == 0
    assert oom.requested_bytes == 20 * MIB
    assert oom.total_bytes == g(15.78)
    assert oom.free_bytes == round(10.81 * MIB)


def test_cuda_runtime_oom_without_figures() -> None:
    oom = recognise("RuntimeError: CUDA error: out of memory")
    assert isinstance(oom, CudaOom)
    assert oom.gpu_index is None and oom.requested_bytes is None and oom.free_bytes is None


def test_vllm_startup_free_memory_check() -> None:
    line = (
        "ValueError: Free memory on device cuda:2 (1.50/79.19 GiB) on startup is less than desired GPU "
        "memory utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory used "
        "by other processes."
    )
    oom = recognise(line)
    assert isinstance(oom, CudaOom)
    assert oom.startup_check
    assert (oom.gpu_index, oom.free_bytes, oom.total_bytes, oom.requested_bytes) == (
        2,
        g(1.5),
        g(79.19),
        g(71.27),
    )
    older = recognise(
        "ValueError: Free memory on device (1.5/79.19 GiB) on startup is less than desired GPU memory "
        "utilization (0.92, 72.85 GiB)."
    )
    assert isinstance(older, CudaOom) and older.gpu_index is None and older.requested_bytes == g(72.85)


@pytest.mark.parametrize(
    ("line", "kind", "value"),
    [
        (
            "(Worker_TP0 pid=12) INFO 10-02 12:00:00 [gpu_worker.py:276] "
            "Available KV cache memory: 23.45 GiB",
            AVAILABLE_KV,
            float(g(23.45)),
        ),
        (
            "(EngineCore_DP0 pid=9) INFO 10-02 12:00:00 [kv_cache_utils.py:1087] GPU KV cache size: "
            "1,234,560 tokens",
            KV_TOKENS,
            1234560.0,
        ),
        ("INFO [kv_cache_utils.py:1] GPU KV cache size: 960 tokens", KV_TOKENS, 960.0),
        (
            "INFO 10-02 12:00:00 [kv_cache_utils.py:1091] Maximum concurrency for 8,192 tokens per request: "
            "150.70x",
            MAX_CONCURRENCY,
            150.70,
        ),
        (
            "INFO 10-02 12:00:00 [gpu_model_runner.py:2007] Model loading took 14.9889 GiB memory and "
            "5.123456 seconds",
            MODEL_LOADING,
            float(round(14.9889 * GIB)),
        ),
    ],
)
def test_vllm_kv_lines(line: str, kind: str, value: float) -> None:
    found = recognise(line)
    assert isinstance(found, KVObservation)
    assert found.kind == kind
    assert found.value == pytest.approx(value)
    assert found.text == line


def test_kv_cache_too_small_error() -> None:
    line = (
        "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (9.50 GiB). Based on the "
        "available memory, the estimated maximum model length is 77824. Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    )
    found = recognise(line)
    assert isinstance(found, KVTooSmall)
    assert (found.max_seq_len, found.needed_bytes, found.available_bytes) == (131072, 16 * GIB, g(9.5))


def test_kv_cache_too_small_older_and_empty_variants() -> None:
    old = recognise(
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can "
        "be stored in KV cache (20000). Try increasing `gpu_memory_utilization`"
    )
    assert isinstance(old, KVTooSmall)
    assert (old.max_seq_len, old.available_tokens, old.needed_bytes) == (32768, 20000, None)
    none_left = recognise(
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`"
    )
    assert isinstance(none_left, KVTooSmall) and none_left.available_bytes == 0


@pytest.mark.parametrize(
    "line",
    [
        "",
        "INFO 10-02 12:00:00 [api_server.py:1] Starting vLLM API server on http://0.0.0.0:8000",
        "INFO 10-02 12:00:00 [gpu_worker.py:1] Memory profiling takes 5.21 seconds",
        'INFO: 127.0.0.1:5000 - "GET /metrics HTTP/1.1" 200 OK',
        "the KV cache is warm",
        "out of memory errors are discussed in the docs",
        "\ufffd\ufffd binary garbage memory \ufffd",
    ],
)
def test_ordinary_lines_are_not_recognised(line: str) -> None:
    assert recognise(line) is None


@given(
    requested=st.integers(min_value=0, max_value=1 << 42),
    free=st.integers(min_value=0, max_value=1 << 42),
    gpu=st.integers(min_value=0, max_value=63),
)
def test_any_printed_size_reads_back_within_rounding(requested: int, free: int, gpu: int) -> None:
    line = (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {pytorch_format(requested)}. "
        f"GPU {gpu} has a total capacity of 79.19 GiB of which {pytorch_format(free)} is free. "
        "Of the allocated memory 1.00 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch "
        "but unallocated."
    )
    oom = recognise(line)
    assert isinstance(oom, CudaOom)
    assert oom.gpu_index == gpu
    assert oom.requested_bytes is not None and oom.free_bytes is not None
    # Two decimals of the printed unit: at most 0.005 units off, i.e. under 0.5 %.
    assert abs(oom.requested_bytes - requested) <= max(1, requested * 0.005)
    assert abs(oom.free_bytes - free) <= max(1, free * 0.005)
