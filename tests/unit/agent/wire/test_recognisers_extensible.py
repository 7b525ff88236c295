"""vLLM 0.34's extensible KV cache lines, rendered from the recorded 0.34.0 snapshot's templates
(never typed by hand): each worker's "Memory after warmup" and the engine's "Disabling the
extensible KV cache: <reason>", read whole, and counted (never read) when cut or garbled."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rankguard_agent.wire.recognisers import (
    KV_TOKENS,
    MAX_CONCURRENCY,
    CudaOom,
    KVObservation,
    Unparsed,
    recognise,
    recognise_all,
)
from rankguard_agent.wire.recognisers_extensible import (
    EXTENSIBLE_KV_DISABLED,
    MEMORY_AFTER_WARMUP,
    AfterWarmup,
    ExtensibleDisabled,
)
from rankguard_agent.wire.report_memory import WarmupMemory
from rankguard_operator import vllm_snapshots

GIB = 1 << 30
SNAP = vllm_snapshots.load("0.34.0")


def format_gib(b: int) -> str:
    """vLLM's format_gib (vllm/utils/mem_utils.py): GiB rounded to 2 decimals, as Python prints it."""
    return f"{round(b / GIB, 2)}"


def messages(key: str) -> list[dict[str, Any]]:
    found = SNAP.messages(key)
    assert found, f"the 0.34.0 snapshot has no {key!r} message"
    return found


def logged(msg: dict[str, Any], values: Sequence[object], who: str, level: str = "INFO") -> str:
    assert msg["style"] == "percent", msg
    text = str(msg["template"]) % tuple(values)
    return f"({who}) {level} 12-01 10:00:00 [{Path(msg['file']).name}:{msg['line']}] {text}"


def near(printed: int, exact: int) -> bool:
    """Within format_gib's rounding (0.005 GiB)."""
    return abs(printed - exact) <= GIB // 200 + 1


# (free, committed, peak, torch growth, blocks, blocks' bytes, requested, torch cap): an H100 at
# utilisation 1.0, a 24 GB card with growth above the peak, and a rank with nothing left.
FIGURES = [
    (int(12.34 * GIB), 2 * GIB, int(3.1 * GIB), GIB, 41_000, int(60.5 * GIB), int(79.19 * GIB), 14 * GIB),
    (int(1.5 * GIB), GIB // 2, GIB // 4, int(1.7 * GIB), 900, int(3.2 * GIB), int(21.67 * GIB), 9 * GIB),
    (0, 0, 0, 0, 0, 0, int(79.19 * GIB), 0),
]


def warmup_line(f: tuple[int, ...], who: str = "Worker_TP1 pid=77", msg: dict[str, Any] | None = None) -> str:
    free, committed, peak, growth, blocks, blocks_bytes, requested, cap = f
    values = (
        format_gib(free),
        format_gib(committed),
        format_gib(max(peak, growth)),  # vLLM prints the larger as what it keeps
        format_gib(peak),
        format_gib(growth),
        blocks,
        format_gib(blocks_bytes),
        format_gib(requested),
        format_gib(cap),
    )
    return logged(msg or messages("memory_after_warmup")[0], values, who)


@pytest.mark.parametrize("figures", FIGURES)
def test_snapshot_memory_after_warmup_gives_every_figure(figures: tuple[int, ...]) -> None:
    free, committed, peak, growth, blocks, blocks_bytes, requested, cap = figures
    for msg in messages("memory_after_warmup"):
        found = recognise_all(warmup_line(figures, msg=msg))
        assert len(found) == 1 and isinstance(found[0], AfterWarmup), found
        got = found[0].memory
        assert isinstance(got, WarmupMemory) and got.blocks == blocks  # exact
        for printed, exact in (
            (got.free_bytes, free),
            (got.committed_bytes, committed),
            (got.kept_bytes, max(peak, growth)),
            (got.peak_bytes, peak),
            (got.torch_growth_bytes, growth),
            (got.blocks_bytes, blocks_bytes),
            (got.requested_bytes, requested),
            (got.torch_cap_bytes, cap),
        ):
            assert near(printed, exact), (printed, exact)


def test_a_cut_memory_after_warmup_is_counted_never_a_value() -> None:
    line = warmup_line(FIGURES[0])
    start = line.index("Memory after warmup:")
    # Every cut that loses a figure or the words after it (the final " GiB." carries the last unit).
    for n in range(start + len("Memory after warmup:"), line.rindex(" GiB")):
        assert recognise_all(line[:n]) == [Unparsed(MEMORY_AFTER_WARMUP, line[:n].strip())], line[:n]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("(3.1 GiB allocated at peak", "(3.7 GiB allocated at peak"),  # kept is no longer max(peak, growth)
        ("3.1 GiB kept", "31 GiB kept"),
        ("12.34 GiB free", "-12.34 GiB free"),
        ("41000 KV cache blocks", "41,000 KV cache blocks"),
        ("Torch may reserve up to 14.0 GiB", "Torch may reserve up to 14.0 TiB"),
    ],
)
def test_a_garbled_memory_after_warmup_is_counted_never_a_value(old: str, new: str) -> None:
    line = warmup_line(FIGURES[0])
    assert old in line, line
    bad = line.replace(old, new)
    assert recognise_all(bad) == [Unparsed(MEMORY_AFTER_WARMUP, bad.strip())]


REASONS = [
    "the driver does not support virtual memory management",
    # a driver error's text (vllm/utils/vmm_driver.py): an "out of memory" there is no OOM
    "GPU driver error 2: out of memory",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",  # periods inside
    "another rank cannot use it",
]


@pytest.mark.parametrize("reason", REASONS)
def test_snapshot_extensible_kv_disabled_gives_the_reason_and_is_no_oom(reason: str) -> None:
    for msg in messages("extensible_kv_disabled"):
        line = logged(msg, (reason,), "EngineCore_DP0 pid=9", "WARNING")
        found = recognise_all(line)
        assert found == [ExtensibleDisabled(line.strip(), reason)]
        assert not isinstance(recognise(line), CudaOom)


def test_a_cut_extensible_kv_disabled_is_counted() -> None:
    msg = messages("extensible_kv_disabled")[0]
    line = logged(msg, (REASONS[0],), "EngineCore_DP0 pid=9", "WARNING")
    cut = line[: line.index(". The KV cache")]
    assert recognise_all(cut) == [Unparsed(EXTENSIBLE_KV_DISABLED, cut.strip())]
    empty = logged(msg, ("",), "EngineCore_DP0 pid=9", "WARNING")
    assert recognise_all(empty) == [Unparsed(EXTENSIBLE_KV_DISABLED, empty.strip())]


@pytest.mark.parametrize("pools", ["GPU", "GPU + host"])
def test_snapshot_kv_cache_size_after_warmup_is_still_read(pools: str) -> None:
    """In the extensible mode the engine core prints its KV size after warm-up (once the workers'
    blocks are known); 0.34 may name the host pool too."""
    for msg in messages("kv_cache_size"):
        line = logged(msg, (pools, f"{2_624_000:,}", f"{131_072:,}", 20.02), "EngineCore_DP0 pid=9")
        kv = {f.kind: f.value for f in recognise_all(line) if isinstance(f, KVObservation)}
        assert kv == {KV_TOKENS: 2_624_000, MAX_CONCURRENCY: pytest.approx(20.02)}, line
