"""Who sizes the KV cache: the engine after warm-up (`engine-measured`) or rankguard (`pinned`).

vLLM 0.34 on CUDA sizes its KV cache from the memory it measures after warm-up and CUDA-graph
capture on every rank, and takes the minimum (the "extensible KV cache"). That measurement sees
everything the engine itself holds, so rankguard steers it (a reserve through
`--gpu-memory-utilization` for what the engine cannot see) instead of switching it off with
`--kv-cache-memory-bytes`. Where the engine cannot measure, rankguard pins the per-GPU bytes as
before. The rule follows 0.34's own `VllmConfig._resolve_extensible_kv_cache` and the worker's
VMM check (recorded in the snapshot's engine.json `extensible_kv_cache`: the reasons it prints,
each connector's `kv_cache_access` flags), never a guess:

- the engine's release has no such mode (before 0.34), or is the CPU build;
- `spec.memory.kvCacheMemoryBytes` pins the budget, or extraArgs give `--num-gpu-blocks-override`;
- a KV connector that shares the cache through legacy CUDA IPC (LMCache's multi-process
  connector), or allocates it from its own pool (`custom_mem_pool`, Mooncake's), or exports it
  with FABRIC handles (NIXL on device memory) while the pod has no IMEX channel (vLLM's default is
  then off: it logs why);
- a node whose driver lacks virtual memory management (the agent says so; vLLM falls back there);
- rankguard fell back to pinned after the engine-measured levers ran out (a lever of its own).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.engine.vllm_cli import VllmCli

ENGINE_MEASURED = "engine-measured"
PINNED = "pinned"

# the connector access flags (vLLM's KVCacheAccess) that decide the mode
LEGACY_IPC = "LEGACY_IPC"
EXPORTS_FABRIC = "EXPORTS_FABRIC"
EXPORTS_FD = "EXPORTS_FD"


@dataclass(frozen=True)
class SizingMode:
    """The mode, why (CamelCase, for status and Events) and a sentence a person reads."""

    mode: str
    reason: str
    message: str

    @property
    def engine_measured(self) -> bool:
        return self.mode == ENGINE_MEASURED

    def to_status(self) -> dict[str, str]:
        return {"mode": self.mode, "reason": self.reason, "message": self.message}


@dataclass(frozen=True)
class ModeFacts:
    """What the rule reads beyond the spec: the release's recorded facts and what the agents saw.

    extensible: the snapshot's engine.json `extensible_kv_cache` (None: the release has no such mode).
    vmm: False when any agent says its node's driver lacks virtual memory management.
    imex_channel: False when any agent says its pod cannot open an IMEX channel; None: not known yet.
    engine_disabled: the reason the engine itself printed when it fell back (None: it did not).
    fallen_back: rankguard pinned the budget after the engine-measured levers ran out.
    """

    version: str
    extensible: Mapping[str, Any] | None
    vmm: bool | None = None
    imex_channel: bool | None = None
    engine_disabled: str | None = None
    fallen_back: bool = False


@dataclass(frozen=True)
class Connector:
    """The KV connector extraArgs configure: its names (MultiConnector's children too), where its
    buffers live, and whether it allocates the cache from its own memory pool."""

    names: tuple[str, ...]
    buffer_device: str
    custom_mem_pool: bool


def connector(extra_args: Sequence[str], cli: VllmCli) -> Connector | None:
    """The `--kv-transfer-config` extraArgs give (the last one wins, as argparse keeps it), read as
    vLLM's KVTransferConfig reads it; None without one (or one that names no connector)."""
    doc = cli.json_object(extra_args, "kv_transfer_config")  # dotted items folded, as vLLM folds them
    if not doc or not isinstance(doc.get("kv_connector"), str):
        return None
    extra = doc.get("kv_connector_extra_config")
    extra = extra if isinstance(extra, Mapping) else {}
    names = [doc["kv_connector"]]
    pools = [bool(extra.get("custom_mem_pool"))]
    if doc["kv_connector"] == "MultiConnector":
        children = extra.get("connectors")
        for child in children if isinstance(children, list) else []:
            if isinstance(child, Mapping) and isinstance(child.get("kv_connector"), str):
                names.append(child["kv_connector"])
                child_extra = child.get("kv_connector_extra_config")
                pools.append(isinstance(child_extra, Mapping) and bool(child_extra.get("custom_mem_pool")))
    device = doc.get("kv_buffer_device")
    return Connector(tuple(names), device if isinstance(device, str) else "cuda", any(pools))


def connector_access(found: Connector, extensible: Mapping[str, Any]) -> tuple[set[str], list[str]]:
    """The access flags the connector's classes declare (MultiConnector: its children's together),
    and the names the snapshot does not know (vLLM would load them from a module path)."""
    table: Mapping[str, Any] = extensible.get("connectors", {})
    flags: set[str] = set()
    unknown: list[str] = []
    children = found.names[1:] if found.names[0] == "MultiConnector" and len(found.names) > 1 else found.names
    side = "cpu" if found.buffer_device == "cpu" else "device"
    for name in children:
        entry = table.get(name)
        if not isinstance(entry, Mapping) or not isinstance(entry.get(side), list):
            unknown.append(name)
            continue
        flags.update(str(f) for f in entry[side])
    return flags, unknown


def _off(reason: str, message: str) -> SizingMode:
    return SizingMode(PINNED, reason, message + "; rankguard pins the per-GPU KV budget in bytes")


def sizing_mode(
    *,
    pinned_by_user: bool,
    extra_args: Sequence[str],
    cli: VllmCli,
    facts: ModeFacts,
) -> SizingMode:
    """The mode of one service. The first reason that applies wins, in 0.34's own order."""
    ext = facts.extensible
    if "+cpu" in facts.version:
        return _off("CpuBuild", f"vLLM {facts.version} is the CPU build, which never measures its KV cache")
    if ext is None:
        return _off(
            "EngineEstimates",
            f"vLLM {facts.version} sizes the KV cache from profiling estimates (it measures after "
            "warm-up from 0.34 on)",
        )
    if pinned_by_user:
        return _off("BudgetPinned", "spec.memory.kvCacheMemoryBytes pins the budget")
    if any(o is not None and o.dest == "num_gpu_blocks_override" for o in _options(extra_args, cli)):
        return _off("BlocksOverride", "extraArgs give --num-gpu-blocks-override, which fixes the block count")
    if facts.fallen_back:
        return _off(
            "FellBackAfterOOMs",
            "the engine-measured levers ran out after CUDA OOMs, so rankguard took the budget over",
        )
    found = connector(extra_args, cli)
    if found is not None:
        off = _connector_off(found, ext, facts.imex_channel)
        if off is not None:
            return off
    if facts.vmm is False:
        return _off(
            "NoVirtualMemory", "a node's GPU driver lacks virtual memory management, which vLLM needs for it"
        )
    if facts.engine_disabled:
        return _off("EngineFellBack", f"the engine turned it off: {facts.engine_disabled}")
    return SizingMode(
        ENGINE_MEASURED,
        "EngineMeasures",
        f"vLLM {facts.version} sizes the KV cache from the memory every rank has free after warm-up "
        "and CUDA-graph capture; rankguard reserves only what the engine cannot see",
    )


def _connector_off(found: Connector, ext: Mapping[str, Any], imex: bool | None) -> SizingMode | None:
    reasons: Mapping[str, str] = ext.get("off_reasons", {})
    flags, unknown = connector_access(found, ext)
    names = "+".join(found.names)
    if LEGACY_IPC in flags:
        return _off("ConnectorLegacyIPC", f"vLLM: {reasons.get('legacy_ipc', 'legacy CUDA IPC')} ({names})")
    if found.custom_mem_pool:
        return _off(
            "ConnectorMemoryPool", f"vLLM: {reasons.get('custom_mem_pool', 'custom_mem_pool')} ({names})"
        )
    if unknown:
        return _off(
            "ConnectorUnknown",
            f"vLLM {ext.get('version', '')} records no such KV connector ({', '.join(unknown)}): how it "
            "reaches the KV cache is not known".replace("  ", " "),
        )
    if EXPORTS_FABRIC in flags and EXPORTS_FD not in flags and imex is not True:
        known = "has no IMEX channel" if imex is False else "is not known to have an IMEX channel"
        return _off(
            "NoIMEXChannel",
            f"the KV connector {names} exports the cache with FABRIC handles and the pod {known}, so "
            "vLLM leaves its measured sizing off by default",
        )
    return None


def _options(extra_args: Sequence[str], cli: VllmCli) -> list[Any]:
    return [word.option for _, word in cli.walk(extra_args)[0]]
