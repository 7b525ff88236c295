"""Recognisers for vLLM 0.34's extensible KV cache lines: PURE functions over one line.

- Each worker's "Memory after warmup: F GiB free, C GiB committed to the KV cache, K GiB kept
  for transient activations (P GiB allocated at peak, G GiB of torch reservation growth); N KV
  cache blocks (B GiB) fit within the requested R GiB. Torch may reserve up to T GiB."
  (vllm/v1/worker/extensible_kv_cache.py `measure_kv_cache_blocks`, snapshot key
  `memory_after_warmup`): what the rank measured after warm-up and CUDA graph capture, and the
  KV cache it sized from it. GiB figures are vLLM's format_gib (2 decimals, as Python prints a
  float).
- The engine core's "Disabling the extensible KV cache: <reason>. The KV cache will be sized
  from profiling estimates instead of measured memory." (vllm/v1/executor/abstract.py
  `disable_extensible_kv_cache`, snapshot key `extensible_kv_disabled`): the mode is off for
  the whole engine, and why.

A line with either marker whose figures cannot be read, or cannot all be true together, is
`Unparsed` under its snapshot key: counted, never acted upon. They live beside
`recognisers.py` (which calls them from `recognise_all`) so that module keeps to its size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rankguard_agent.wire.report_memory import WarmupMemory

GIB = 1 << 30
_GNUM = r"-?\d+(?:\.\d+)?"  # format_gib's float, as recognisers._GNUM

# Unparsed kinds: the snapshot's keys of these lines.
MEMORY_AFTER_WARMUP = "memory_after_warmup"
EXTENSIBLE_KV_DISABLED = "extensible_kv_disabled"

_WARMUP_MARKER = "Memory after warmup:"
# One pattern for the whole sentence: every figure is anchored on the words around it, so a
# reworded or cut line cannot hand a figure to the wrong field.
_WARMUP = re.compile(
    rf"Memory after warmup: ({_GNUM}) GiB free, ({_GNUM}) GiB committed to the KV cache, "
    rf"({_GNUM}) GiB kept for transient activations \(({_GNUM}) GiB allocated at peak, "
    rf"({_GNUM}) GiB of torch reservation growth\); (\d+) KV cache blocks \(({_GNUM}) GiB\) "
    rf"fit within the requested ({_GNUM}) GiB\. Torch may reserve up to ({_GNUM}) GiB"
)
_DISABLED_MARKER = "Disabling the extensible KV cache:"
# The reason is free text (often an exception's message, which may hold periods of its own):
# it ends where vLLM's next sentence begins.
_DISABLED = re.compile(r"Disabling the extensible KV cache: (.+?)\. The KV cache will be sized ")
# What every line these recognisers read contains (recognisers.py pre-filters lines with them).
KEYWORDS = (_WARMUP_MARKER, _DISABLED_MARKER)


@dataclass(frozen=True)
class AfterWarmup:
    """A worker's "Memory after warmup" line."""

    text: str
    memory: WarmupMemory


@dataclass(frozen=True)
class ExtensibleDisabled:
    """The engine turned the extensible KV cache off (on every rank), and said why."""

    text: str
    reason: str


@dataclass(frozen=True)
class UnreadLine:
    """A line with one of these markers that cannot be read (recognisers.Unparsed's shape; the
    caller turns it into one, so that this module needs nothing from recognisers.py)."""

    kind: str
    text: str


def _gib(text: str) -> int:
    return round(float(text) * GIB)


def recognise_warmup(line: str) -> AfterWarmup | UnreadLine | None:
    if _WARMUP_MARKER not in line:
        return None
    text = line.strip()
    m = _WARMUP.search(line)
    if m is None:
        return UnreadLine(MEMORY_AFTER_WARMUP, text)
    free, committed, kept, peak, growth, blocks, blocks_gib, requested, cap = m.groups()
    memory = WarmupMemory(
        free_bytes=_gib(free),
        committed_bytes=_gib(committed),
        kept_bytes=_gib(kept),
        peak_bytes=_gib(peak),
        torch_growth_bytes=_gib(growth),
        blocks=int(blocks),
        blocks_bytes=_gib(blocks_gib),
        requested_bytes=_gib(requested),
        torch_cap_bytes=_gib(cap),
    )
    figures = (float(f) for f in (free, committed, kept, peak, growth, blocks_gib, requested, cap))
    plausible = (
        all(f >= 0 for f in figures)
        # vLLM prints kept = max(peak, growth), each rounded the same way: a garbled digit
        # in any of the three breaks the equality.
        and float(kept) == max(float(peak), float(growth))
    )
    return AfterWarmup(text, memory) if plausible else UnreadLine(MEMORY_AFTER_WARMUP, text)


def recognise_disabled(line: str) -> ExtensibleDisabled | UnreadLine | None:
    if _DISABLED_MARKER not in line:
        return None
    text = line.strip()
    m = _DISABLED.search(line)
    if m is None or not m.group(1).strip():
        return UnreadLine(EXTENSIBLE_KV_DISABLED, text)
    return ExtensibleDisabled(text, m.group(1).strip())


def recognise_extensible(line: str) -> AfterWarmup | ExtensibleDisabled | UnreadLine | None:
    """What this line says about vLLM 0.34's extensible KV cache, or None (the usual case)."""
    if not any(k in line for k in KEYWORDS):
        return None
    return recognise_warmup(line) or recognise_disabled(line)
