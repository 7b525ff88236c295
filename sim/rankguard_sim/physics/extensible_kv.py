"""vLLM 0.34's extensible KV cache as the world plays it: whether it is on, and what it measures.

Read from the 0.34.0 wheel (never imported; every fact comes from the recorded snapshot's
engine.json `extensible_kv_cache`, `ExtensibleFacts`):

* `resolve_mode` is vllm/config/vllm.py `_resolve_extensible_kv_cache`: unset, the mode is on
  where supported; unsupported (in this order) with `--kv-cache-memory-bytes`,
  `--num-gpu-blocks-override`, elastic EP, a connector that shares the cache through legacy CUDA
  IPC, a connector's custom memory pool; a connector that exports FABRIC handles turns the
  default off without an IMEX channel in the pod; a connector that imports it through POSIX file
  descriptors needs it (an error when it is off); `--enable-extensible-kv-cache` where
  unsupported is an error. The CPU platform and ROCm never reach the sandbox (it plays CUDA).
  A driver without virtual memory management is found later, at start-up (the engine's fallback,
  `extensible_kv_disabled`), not here.
* `measure_kv_cache_bytes` is vllm/v1/worker/extensible_kv_cache.py's, line for line;
  `measure_kv_cache_blocks` its caller's arithmetic: the blocks that fit, the utilisation warning's
  withheld bytes, and the cap on torch's caching allocator (what torch held after warm-up plus
  what stays free once the cache is extended, less the non-torch reserve).

Not modelled: the VMM granule (2 MiB) each layer's committed segment is rounded to, so blocks
are `bytes // bytes per block` here, at most a granule per layer more than vLLM's count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

PLATFORM = "cuda"  # the sandbox's GPUs are CUDA devices


@dataclass(frozen=True)
class ExtensibleFacts:
    """engine.json's `extensible_kv_cache` of one release, for the CUDA platform."""

    default_utilization: float  # resolved gpu_memory_utilization when the mode is on and unset
    estimate_default_utilization: float  # ... when it is off (estimate-based sizing)
    margin_floor_bytes: int
    margin_fraction: float
    non_torch_reserve_bytes: int
    warn_above: float
    warn_below: float
    warn_withheld_bytes: int
    off_reasons: Mapping[str, str] = field(default_factory=dict)
    # connector name -> {"device": [access flags], "cpu": [...]} (by kv_buffer_device)
    connectors: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)

    @classmethod
    def from_engine(cls, doc: Mapping[str, Any]) -> ExtensibleFacts:
        warning = doc["warning"]
        connectors = {  # a connector recorded with an import error has no flags to read
            str(name): {str(k): tuple(map(str, v)) for k, v in dict(access).items() if isinstance(v, list)}
            for name, access in dict(doc.get("connectors") or {}).items()
        }
        return cls(
            default_utilization=float(doc["default_utilization"]),
            estimate_default_utilization=float(doc["estimate_default_utilization"]),
            margin_floor_bytes=int(_on_platform(doc["margin_floor_bytes"])),
            margin_fraction=float(_on_platform(doc["margin_fraction"])),
            non_torch_reserve_bytes=int(_on_platform(doc["non_torch_reserve_bytes"])),
            warn_above=float(warning["above"]),
            warn_below=float(warning["below"]),
            warn_withheld_bytes=int(warning["withheld_bytes"]),
            off_reasons={str(k): str(v) for k, v in dict(doc.get("off_reasons") or {}).items()},
            connectors=connectors,
        )

    def access(self, connector: str | None, kv_buffer_device: str = "cuda") -> frozenset[str]:
        """The recorded access flags of a connector, empty for none or an unknown one."""
        if not connector:
            return frozenset()
        found = self.connectors.get(connector, {})
        return frozenset(found.get("cpu" if kv_buffer_device == "cpu" else "device", ()))


def _on_platform(value: Any) -> Any:
    """A fact recorded per platform ({"cuda": …, "rocm": …}) or once for all."""
    return value[PLATFORM] if isinstance(value, Mapping) else value


def transfer_access(
    facts: ExtensibleFacts, transfer: Mapping[str, Any] | None
) -> tuple[frozenset[str], bool]:
    """(the access flags, whether it allocates from a custom memory pool) of a --kv-transfer-config:
    its connector's, or every child's under MultiConnector (vllm/config/kv_transfer.py)."""
    if not transfer:
        return frozenset(), False
    device = str(transfer.get("kv_buffer_device") or "cuda")
    extra = transfer.get("kv_connector_extra_config") or {}
    configs = [transfer]
    if transfer.get("kv_connector") == "MultiConnector" and isinstance(extra, Mapping):
        configs += [c for c in extra.get("connectors", []) if isinstance(c, Mapping)]
    flags: set[str] = set()
    pool = False
    for c in configs:
        flags |= facts.access(str(c.get("kv_connector") or ""), str(c.get("kv_buffer_device") or device))
        own = c.get("kv_connector_extra_config") or {}
        pool = pool or bool(isinstance(own, Mapping) and own.get("custom_mem_pool"))
    return frozenset(flags), pool


# ---------------------------------------------------------------------------------------------
# The mode


@dataclass(frozen=True)
class Mode:
    """The resolved `enable_extensible_kv_cache`: on, or off and why; `error` is vLLM's refusal."""

    enabled: bool
    reason: str | None = None  # an off_reasons key (or "imex_channel"): why it is off
    error: str | None = None  # the ValueError vLLM raises for these flags

    @property
    def why(self) -> str:
        return self.reason or ""


def resolve_mode(
    facts: ExtensibleFacts,
    *,
    requested: bool | None,
    kv_cache_memory_bytes: int | None = None,
    num_gpu_blocks_override: int | None = None,
    elastic_ep: bool = False,
    access: frozenset[str] = frozenset(),
    custom_mem_pool: bool = False,
    imex_channel: bool = False,
) -> Mode:
    """`_resolve_extensible_kv_cache` for one command line (`requested`: the flag, None unset;
    `access`, `custom_mem_pool`: the KV connector's, `transfer_access`)."""
    unsupported = None
    if kv_cache_memory_bytes is not None:
        unsupported = "kv_cache_memory_bytes"
    elif num_gpu_blocks_override is not None:
        unsupported = "num_gpu_blocks_override"
    elif elastic_ep:
        unsupported = "elastic_ep"
    elif "LEGACY_IPC" in access:
        unsupported = "legacy_ipc"
    elif custom_mem_pool:
        unsupported = "custom_mem_pool"
    exports_fd = "EXPORTS_FD" in access
    if exports_fd and (requested is False or unsupported is not None):
        why = facts.off_reasons.get(unsupported, "") if unsupported else "it is disabled"
        return Mode(False, unsupported, _needs_it_error(why))
    fabric_unavailable = "EXPORTS_FABRIC" in access and not imex_channel
    if requested is None:
        if unsupported is not None:
            return Mode(False, unsupported)
        if fabric_unavailable and not exports_fd:
            return Mode(False, "imex_channel")
        return Mode(True)
    if requested and unsupported is not None:
        why = facts.off_reasons.get(unsupported, "")
        return Mode(False, unsupported, f"enable_extensible_kv_cache: {why}.")
    if not requested:
        return Mode(False, "disabled")
    return Mode(True)


def _needs_it_error(why: str) -> str:
    # vLLM's f-string (vllm/config/vllm.py, `_resolve_extensible_kv_cache`) around the reason
    return (
        "enable_extensible_kv_cache: a KV connector (e.g. LMCacheMPConnector with "
        "lmcache.mp.use_vmm_api) imports the KV cache through POSIX file descriptors, which "
        f"needs it, but {why}."
    )


# ---------------------------------------------------------------------------------------------
# What it measures after warm-up


def measure_kv_cache_bytes(
    *,
    init_free_memory: int,
    free_memory: int,
    committed_bytes: int,
    requested_memory: int,
    transient_peak_bytes: int = 0,
    torch_reserve_growth_bytes: int = 0,
    margin_floor_bytes: int,
    margin_fraction: float,
) -> int:
    """Bytes the KV cache may occupy given the memory measured after warm-up (vLLM's own function:
    everything resident but the committed KV prefix is the engine's; the cache gets the rest of
    the budget, capped by the headroom less the margin, then the larger transient is kept free)."""
    non_kv_used = init_free_memory - free_memory - committed_bytes
    headroom = free_memory + committed_bytes
    margin = max(margin_floor_bytes, int(transient_peak_bytes * margin_fraction))
    available = min(requested_memory - non_kv_used, headroom - margin)
    available -= max(transient_peak_bytes, torch_reserve_growth_bytes)
    return max(available, 0)


@dataclass(frozen=True)
class WarmupMeasurement:
    """One rank's "Memory after warmup" figures (and what it does not print: the budget bytes)."""

    rank: int
    free_bytes: int
    committed_bytes: int
    kept_bytes: int  # max(peak, torch growth): kept for transient activations
    peak_bytes: int
    torch_growth_bytes: int
    blocks: int
    blocks_bytes: int
    requested_bytes: int
    torch_cap_bytes: int
    available_bytes: int
    withheld_bytes: int | None  # the utilisation warning's figure; None when it is not checked

    def warns(self, facts: ExtensibleFacts) -> bool:
        return self.withheld_bytes is not None and self.withheld_bytes >= facts.warn_withheld_bytes


def measure_kv_cache_blocks(
    facts: ExtensibleFacts,
    *,
    rank: int,
    init_free: int,
    free: int,
    committed: int,
    requested: int,
    transient_peak: int,
    torch_growth: int,
    torch_reserved: int,
    block_bytes: int,
    capacity_blocks: int,
    utilization: float | None,
) -> WarmupMeasurement:
    """`measure_kv_cache_blocks`: the blocks this rank fits and torch's cap after warm-up.

    `utilization` is the user's --gpu-memory-utilization (None: unset), whose warning is checked
    only strictly between the facts' bounds; `torch_reserved` what torch's caching allocator
    holds once emptied (weights, CUDA graphs).
    """
    measured = {
        "init_free_memory": init_free,
        "free_memory": free,
        "committed_bytes": committed,
        "transient_peak_bytes": transient_peak,
        "torch_reserve_growth_bytes": torch_growth,
        "margin_floor_bytes": facts.margin_floor_bytes,
        "margin_fraction": facts.margin_fraction,
    }
    available = measure_kv_cache_bytes(requested_memory=requested, **measured)  # type: ignore[arg-type]
    withheld = None
    if utilization is not None and facts.warn_above < utilization < facts.warn_below:
        unbounded = measure_kv_cache_bytes(requested_memory=init_free, **measured)  # type: ignore[arg-type]
        withheld = unbounded - available
    blocks = min(available // block_bytes, capacity_blocks) if block_bytes > 0 else 0
    left_free = free - (blocks * block_bytes - committed) - facts.non_torch_reserve_bytes
    return WarmupMeasurement(
        rank=rank,
        free_bytes=free,
        committed_bytes=committed,
        kept_bytes=max(transient_peak, torch_growth),
        peak_bytes=transient_peak,
        torch_growth_bytes=torch_growth,
        blocks=blocks,
        blocks_bytes=blocks * block_bytes,
        requested_bytes=requested,
        torch_cap_bytes=torch_reserved + max(left_free, 0),
        available_bytes=available,
        withheld_bytes=withheld,
    )
