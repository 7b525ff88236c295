"""`status.engine` and the EngineRules condition: which vLLM runs, whose rules apply, and what
the engine itself said about each rank's memory.

The engine's per-worker memory report is printed only by a start-up without
--kv-cache-memory-bytes, i.e. once, before rankguard sets a byte budget. Its figures are
therefore kept in status (with the budget key they were measured under) and used by every
later plan until the spec's budget inputs change; a fresh report replaces them.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.conditions import Condition, set_condition
from rankguard_operator.core.engine.rules import Rules, image_version, rules_for
from rankguard_operator.core.observe.headroom import Observation
from rankguard_operator.core.observe.pods import Termination
from rankguard_operator.core.spec.parse import ServiceSpec
from rankguard_operator.core.status.service_state import ServiceState


@dataclass(frozen=True)
class EngineView:
    version: str | None
    source: str  # "agent" | "image" | "unknown"
    rules: Rules
    non_kv: Mapping[int, int]  # rank -> the engine's own non-KV bytes
    rows: tuple[Mapping[str, Any], ...]  # status.engine.ranks
    # the least free memory any rank had when its worker started, as vLLM measured it (its
    # per-worker report, or its start-up refusal): what its start-up check compares with
    startup_free_bytes: int | None = None
    # the most weight bytes another process held on one GPU (a zero-copy weight cache) when vLLM
    # refused to start because they reached utilisation × total: the utilisation rendered next to
    # a byte budget must rise above them, and its check of free memory counts them as the engine's
    external_weight_bytes: int | None = None
    # engine lines the agents could not read, by kind (a garbled or newer format)
    unread: Mapping[str, int] = field(default_factory=dict)


def engine_view(
    state: ServiceState,
    spec: ServiceSpec,
    observation: Observation | None,
    key: str,
    terminations: Sequence[Termination] = (),
) -> EngineView:
    reported = observation.engine_version if observation is not None else None
    tagged = image_version(spec.image)
    version, source = (reported, "agent") if reported else (tagged, "image") if tagged else (None, "unknown")
    kept_rows, kept_free, kept_external = state.kept_engine(key)
    rows: dict[int, Mapping[str, Any]] = {int(r["rank"]): r for r in kept_rows}
    fresh = observation.fresh_ranks if observation is not None else ()
    for r in fresh:
        if r.engine is not None:
            e = r.engine
            rows[r.rank] = {
                "rank": r.rank,
                "nonKVBytes": e.non_kv_bytes,
                "consumedBytes": e.consumed_bytes,
                "peakActivationBytes": e.peak_activation_bytes,
                "cudaGraphBytes": e.cuda_graph_bytes,
                "freeAtStartBytes": e.free_at_start_bytes,
                "totalBytes": e.total_bytes,
            }
    ordered = tuple(rows[k] for k in sorted(rows))
    free = [int(r["freeAtStartBytes"]) for r in ordered if isinstance(r.get("freeAtStartBytes"), int)]
    free += [t.free_bytes for t in terminations if t.startup_refusal and t.free_bytes]
    free += [r.engine_free_at_start for r in fresh if r.engine_free_at_start is not None]
    if kept_free is not None:
        free.append(kept_free)
    external = [
        t.external_weight_bytes for t in terminations if t.startup_refusal and t.external_weight_bytes
    ]
    if kept_external is not None:
        external.append(kept_external)
    return EngineView(
        version=version,
        source=source,
        rules=rules_for(version),
        non_kv={int(r["rank"]): int(r["nonKVBytes"]) for r in ordered},
        rows=ordered,
        startup_free_bytes=min(free) if free else None,
        external_weight_bytes=max(external) if external else None,
        unread=dict(observation.unparsed_lines) if observation is not None else {},
    )


def engine_status(view: EngineView, key: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"versionSource": view.source, "rules": view.rules.version, "budgetKey": key}
    if view.version is not None:
        doc["version"] = view.version
    # which release's rules applied, and why not the engine's own: kept beside `rules` (the
    # EngineRules condition says it too, as a sentence; no Event, which would say it a third time)
    note = _note(view)
    if note is not None:
        doc["rulesNote"] = note
    if view.rows:
        doc["ranks"] = [dict(r) for r in view.rows]
    if view.startup_free_bytes is not None:
        doc["startupFreeBytes"] = view.startup_free_bytes
    if view.external_weight_bytes is not None:
        doc["externalWeightBytes"] = view.external_weight_bytes
    return doc


# Where the recorded rules may trail the engine, the engine's own vLLM does not: the agent has it
# judge the arguments before the engine starts (docs/vllm-flags.md)
POD_JUDGES = (
    "the pod's own vLLM judges the arguments before the engine starts, and a refusal is said as "
    "EngineRefusedArguments"
)


def _note(view: EngineView) -> str | None:
    """Why the rules are not the engine's own release's, bounded as the CRD keeps it; None: they are."""
    if view.version is None:
        why = (
            "no agent has reported the vLLM version and the image tag names none; "
            f"using vLLM {view.rules.version}'s recorded rules"
        )
    elif view.rules.note is not None:
        why = view.rules.note
    else:
        return None
    return f"{why}; {POD_JUDGES}"[:512]


def with_rules_condition(
    conditions: Sequence[Mapping[str, Any]], view: EngineView, now_iso: str, generation: int
) -> list[dict[str, Any]]:
    note = _note(view)
    if view.version is None:
        status, reason, message = "Unknown", "VersionUnknown", note or ""
    elif note is not None:
        status, reason, message = "False", "NearestSnapshot", note
    else:
        status, reason = "True", "Recorded"
        message = f"vLLM {view.version} (from the {view.source}): its recorded CLI and log formats apply"
    if view.unread:
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(view.unread.items()))
        message += (
            f". The agents could not read some engine lines ({counts}); their figures are not used "
            "(rankguard_agent_unparsed_lines_total)"
        )
        if status == "True":
            status, reason = "False", "UnreadEngineLines"
    return set_condition(conditions, Condition.ENGINE_RULES, status, reason, message, now_iso, generation)
