"""`status.sizing`: who sizes the KV cache and why, the reserve rendered for what the engine
cannot see, and each rank's measurement after warm-up (vLLM 0.34's "Memory after warmup" line)
beside the memory other processes hold on its GPU, with what the agents said of their pods (VMM,
an IMEX channel, the engine's own fallback): core/observe/outside_memory.kept reads it back.

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.sizing_mode import SizingMode
from rankguard_operator.core.observe.outside_memory import Outside


def sizing_status(mode: SizingMode, found: Outside, flags: ServingFlags | None) -> dict[str, Any]:
    doc: dict[str, Any] = mode.to_status()
    if flags is not None and flags.engine_measured and flags.gpu_memory_utilization is not None:
        total = max((r.total_bytes for r in found.ranks), default=0)
        held = f", {round((1 - flags.gpu_memory_utilization) * total)} bytes of each GPU" if total else ""
        doc["reserve"] = f"gpu-memory-utilization {flags.gpu_memory_utilization:g}{held}"
    rows: dict[int, dict[str, Any]] = {int(w["rank"]): dict(w) for w in found.warmup}
    for r in found.ranks:
        row = rows.setdefault(r.rank, {"rank": r.rank})
        row.update(
            uuid=r.uuid,
            pod=r.pod,
            totalBytes=r.total_bytes,
            othersBytes=r.others_bytes,
            othersPeakBytes=r.others_peak_bytes,
        )
        if r.biggest:
            row["largestOther"] = r.biggest
        if r.free_at_load_bytes is not None:
            row["freeAtLoadBytes"] = r.free_at_load_bytes
        if r.others_at_load_bytes is not None:
            row["othersAtLoadBytes"] = r.others_at_load_bytes
    if rows:
        doc["ranks"] = [rows[k] for k in sorted(rows)]
    # what the agents said of their pods, kept for a pass whose pods do not report
    facts = (
        ("vmm", found.vmm),
        ("imexChannel", found.imex_channel),
        ("engineDisabled", found.engine_disabled),
    )
    doc.update((key, value) for key, value in facts if value is not None)
    return doc
