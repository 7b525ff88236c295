"""The serving flags rankguard manages at run time: the KV budget, the container memory limit and
the OOM levers (max-num-seqs, max-num-batched-tokens, max-cudagraph-capture-size, enforce-eager).

`ServingFlags` is the small piece of state the policy changes (everything else in the
Deployment follows from the spec). A lever left None means "as spec.engine says"; the policy
sets one after a CUDA OOM in the phase it answers (core/policy/oom_levers.py). It travels three
ways: into the rendered Deployment (as vLLM flags and a resource limit), into `.status`
(`to_status` / `from_status`, camelCase, as the CRD's `lastKnownGood` object spells them), and
into Events (`describe`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from rankguard_operator.core.units import QuantityError, format_bytes, format_quantity, parse_bytes

# The OOM levers: field -> its key in `.status` (the CRD's flags objects spell them so).
LEVER_KEYS: dict[str, str] = {
    "max_num_seqs": "maxNumSeqs",
    "max_num_batched_tokens": "maxNumBatchedTokens",
    "max_cudagraph_capture_size": "maxCudaGraphCaptureSize",
    "enforce_eager": "enforceEager",
}
LEVER_INTS = ("max_num_seqs", "max_num_batched_tokens", "max_cudagraph_capture_size")


T = TypeVar("T", int, bool)


class FlagsError(ValueError):
    """Impossible serving flags (a negative budget, a utilisation outside (0, 1])."""


@dataclass(frozen=True)
class ServingFlags:
    """What the vLLM container runs with, beyond the spec.

    kv_cache_memory_bytes: `--kv-cache-memory-bytes` (one value for every rank). When set it
        wins: vLLM then ignores `--gpu-memory-utilization`, so only one of the two is rendered.
    gpu_memory_utilization: `--gpu-memory-utilization`, used only while no byte budget is known.
    memory_limit_bytes: the container's host-memory limit; None means "as spec.resources says".
    max_num_seqs, max_num_batched_tokens: `--max-num-seqs`, `--max-num-batched-tokens`; None:
        spec.engine's.
    max_cudagraph_capture_size: `--max-cudagraph-capture-size` (rendered only when set and the
        engine is not eager); None: vLLM's own default.
    enforce_eager: `--enforce-eager` when True; None: spec.engine.enforceEager.
    engine_measured: the engine sizes its KV cache itself after warm-up (vLLM 0.34's measured
        sizing, core/engine/sizing_mode.py): never a byte budget; `gpu_memory_utilization`, when
        set, is rankguard's reserve for what the engine cannot see (core/budget/reserve.py).
    pinned_after_ooms: rankguard pinned the budget in bytes after the engine-measured levers ran
        out (the last lever of that mode); kept until the spec's budget inputs change.
    """

    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    memory_limit_bytes: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_cudagraph_capture_size: int | None = None
    enforce_eager: bool | None = None
    engine_measured: bool = False
    pinned_after_ooms: bool = False

    def __post_init__(self) -> None:
        kv = self.kv_cache_memory_bytes
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1):
            raise FlagsError(f"kv_cache_memory_bytes must be a positive integer, got {kv!r}")
        u = self.gpu_memory_utilization
        if u is not None and (
            isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u) or not 0 < u <= 1
        ):
            raise FlagsError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        m = self.memory_limit_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise FlagsError(f"memory_limit_bytes must be a positive integer, got {m!r}")
        for name in LEVER_INTS:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise FlagsError(f"{name} must be a positive integer, got {v!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise FlagsError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if not isinstance(self.engine_measured, bool) or not isinstance(self.pinned_after_ooms, bool):
            raise FlagsError("engine_measured and pinned_after_ooms must be true or false")
        if self.engine_measured and kv is not None:
            # --kv-cache-memory-bytes turns the engine's own measurement off (vLLM 0.34)
            raise FlagsError("an engine-measured KV cache has no byte budget")

    @property
    def uses_bytes(self) -> bool:
        """True when the KV budget is explicit bytes (rankguard's normal mode)."""
        return self.kv_cache_memory_bytes is not None

    def with_kv(self, kv_cache_memory_bytes: int) -> ServingFlags:
        """The same flags with an explicit byte budget (which replaces any utilisation, and the
        engine's own measurement)."""
        return replace(
            self,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=None,
            engine_measured=False,
        )

    def with_memory_limit(self, memory_limit_bytes: int | None) -> ServingFlags:
        return replace(self, memory_limit_bytes=memory_limit_bytes)

    def or_spec(self, field: str, spec_value: T) -> T:
        """A lever's value in effect: the one rankguard set, else the spec's (`spec_value`)."""
        value = getattr(self, field)
        return spec_value if value is None else value

    def levers(self) -> tuple[int | bool | None, ...]:
        """The OOM levers, in LEVER_KEYS' order (None: as the spec says)."""
        return tuple(getattr(self, name) for name in LEVER_KEYS)

    def budget_text(self) -> str:
        """The KV budget as the KV-BUDGET column shows it: `27.6Gi`, `util 0.92`, `vllm default`,
        or `measured` (`measured, util 0.93` with a reserve)."""
        if self.engine_measured:
            u = self.gpu_memory_utilization
            return "measured" if u is None else f"measured, util {u:g}"
        if self.kv_cache_memory_bytes is not None:
            return format_bytes(self.kv_cache_memory_bytes)
        if self.gpu_memory_utilization is not None:
            return f"util {self.gpu_memory_utilization:g}"
        return "vllm default"

    def describe(self) -> str:
        """One line for Events and messages: `kv-cache-memory-bytes 27.6Gi, max-num-seqs 128,
        enforce-eager, memory limit 64Gi` (every lever that is set)."""
        if self.engine_measured:
            u = self.gpu_memory_utilization
            parts = [
                "the KV cache vLLM measures after warm-up"
                + ("" if u is None else f" (reserve: gpu-memory-utilization {u:g})")
            ]
        elif self.kv_cache_memory_bytes is not None:
            parts = [f"kv-cache-memory-bytes {format_bytes(self.kv_cache_memory_bytes)}"]
        elif self.gpu_memory_utilization is not None:
            parts = [f"gpu-memory-utilization {self.gpu_memory_utilization:g}"]
        else:
            parts = ["vLLM's default KV budget"]
        for name in LEVER_INTS:
            v = getattr(self, name)
            if v is not None:
                parts.append(f"{name.replace('_', '-')} {v}")
        if self.enforce_eager is not None:
            parts.append("enforce-eager" if self.enforce_eager else "no-enforce-eager")
        if self.memory_limit_bytes is not None:
            parts.append(f"memory limit {format_bytes(self.memory_limit_bytes)}")
        return ", ".join(parts)

    def to_status(self) -> dict[str, Any]:
        """camelCase for `.status` (the CRD's lastKnownGood object); unset fields are left out.

        The memory limit is written as an exact Kubernetes quantity (`memoryLimit: 64Gi`), the
        form the CRD declares; `from_status` reads it back without loss."""
        doc: dict[str, Any] = {}
        if self.kv_cache_memory_bytes is not None:
            doc["kvCacheMemoryBytes"] = self.kv_cache_memory_bytes
        if self.gpu_memory_utilization is not None:
            doc["gpuMemoryUtilization"] = float(self.gpu_memory_utilization)
        if self.memory_limit_bytes is not None:
            doc["memoryLimit"] = format_quantity(self.memory_limit_bytes)
        for name, key in LEVER_KEYS.items():
            v = getattr(self, name)
            if v is not None:
                doc[key] = v
        if self.engine_measured:
            doc["engineMeasured"] = True
        if self.pinned_after_ooms:
            doc["pinnedAfterOOMs"] = True
        return doc

    @classmethod
    def from_status(cls, doc: Any) -> ServingFlags | None:
        """Read `to_status` output back. None when there is nothing (or nothing valid) to read:
        status is written by us, but a person can edit it, and a bad status must not crash us."""
        if not isinstance(doc, Mapping) or not doc:
            return None
        try:
            kv = _opt_int(doc.get("kvCacheMemoryBytes"))
            util = doc.get("gpuMemoryUtilization")
            if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float))):
                return None
            limit_raw = doc.get("memoryLimit", doc.get("memoryLimitBytes"))
            limit = None if limit_raw is None else parse_bytes(limit_raw)
            levers = {name: _opt_int(doc.get(key)) for name, key in LEVER_KEYS.items() if name in LEVER_INTS}
            eager = doc.get(LEVER_KEYS["enforce_eager"])
            if eager is not None and not isinstance(eager, bool):
                return None
            measured = doc.get("engineMeasured", False)
            after_ooms = doc.get("pinnedAfterOOMs", False)
            if not isinstance(measured, bool) or not isinstance(after_ooms, bool):
                return None
            if (
                kv is None
                and util is None
                and limit is None
                and eager is None
                and not measured
                and not any(levers.values())
            ):
                return None
            return cls(
                engine_measured=measured,
                pinned_after_ooms=after_ooms,
                kv_cache_memory_bytes=kv,
                gpu_memory_utilization=None if util is None else float(util),
                memory_limit_bytes=limit,
                enforce_eager=eager,
                **levers,
            )
        except (FlagsError, QuantityError, TypeError, ValueError):
            return None


def _opt_int(v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {v!r}")
    return v
