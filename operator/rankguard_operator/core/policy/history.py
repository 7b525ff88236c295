"""The remediation history: what rankguard changed, when and why, as kept in `.status`.

`Remediation` is one automatic change; `to_status` / `from_status` map it to the CRD's
`status.remediations[]` item (time, trigger, action, rank, the pod and the group of a multi-node
service, from, to, revision, message, and for a CUDA OOM answered by a lever its phase and lever)
and back. The policy reads the history for
its guard rails (cooldown, changes per hour, the budgets that failed in the last day) and for
the OOM levers' escalation (oom_levers.py).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy.tunables import LEVER_FIELDS, LEVERS, MEASURED_LEVERS
from rankguard_operator.core.units import QuantityError, format_quantity, iso, parse_bytes, parse_iso

# Decision actions -> the CRD's action names.
STATUS_ACTIONS: dict[str, str] = {
    "initial": "Initial",
    "shrink": "ShrinkKVCache",
    "degrade": "ShrinkKVCache",  # a degrade that changes flags sets the floor: a shrink
    "grow": "GrowKVCache",
    "replan": "Replan",
    "raise-memory-limit": "BumpMemoryLimit",
    "rollback": "Rollback",
    "lower-batched-tokens": "LowerMaxNumBatchedTokens",
    "lower-num-seqs": "LowerMaxNumSeqs",
    "lower-capture-size": "LowerCudaGraphCaptureSize",
    "enforce-eager": "EnforceEager",
    "raise-reserve": "RaiseReserve",
    "pin-budget": "PinBudget",
}
# ... and back: one action per name ("degrade" writes its change as the shrink it is)
_FROM_STATUS_ACTIONS = {name: action for action, name in STATUS_ACTIONS.items() if action != "degrade"}


@dataclass(frozen=True)
class Remediation:
    """One automatic change, as kept (bounded) in `.status.remediations`."""

    time: float
    trigger: str
    action: str  # a Decision action: shrink, grow, replan, raise-memory-limit, rollback, degrade
    rank: int | None
    from_flags: ServingFlags | None
    to_flags: ServingFlags
    revision: str | int | None = None
    message: str = ""
    phase: str | None = None  # the engine phase of the CUDA OOM it answered (None: unknown)
    lever: str | None = None  # the OOM lever it moved (tunables.LEVERS)
    lever_from: int | bool | None = None  # that lever's value before (the spec's when no flag set it)
    # where it happened: the pod whose run or figures triggered it, and its group (multi-node);
    # a person reading the history of a 16-pod service needs more than a rank (issue 50)
    pod: str | None = None
    group: int | None = None

    def to_status(self) -> dict[str, Any]:
        """The CRD's remediation item; from/to carry the value that changed (bytes for the KV
        budget, a quantity for the memory limit, `util=0.92` for a utilisation, the lever's own
        value for another OOM lever: 128, or "true" for enforce-eager), and fromFlags/toFlags
        keep the whole flags."""
        doc: dict[str, Any] = {
            "time": iso(self.time),
            "trigger": self.trigger,
            "action": STATUS_ACTIONS.get(self.action, self.action),
            "message": self.message[:1024],
        }
        if self.rank is not None:
            doc["rank"] = self.rank
        if self.pod is not None:
            doc["pod"] = self.pod[:253]
        if self.group is not None:
            doc["group"] = self.group
        if self.phase is not None:
            doc["phase"] = self.phase
        if self.lever is not None:
            doc["lever"] = self.lever
        field = LEVER_FIELDS.get(self.lever or "", "kv_cache_memory_bytes")
        if field != "kv_cache_memory_bytes":
            frm, to = _lever_scalar(self.lever_from), _lever_scalar(getattr(self.to_flags, field))
        else:
            limit_changed = self.action == "raise-memory-limit" or (
                self.from_flags is not None
                and self.from_flags.kv_cache_memory_bytes == self.to_flags.kv_cache_memory_bytes
                and self.from_flags.gpu_memory_utilization == self.to_flags.gpu_memory_utilization
            )
            frm = _scalar(self.from_flags, limit_changed)
            to = _scalar(self.to_flags, limit_changed)
        if frm is not None:
            doc["from"] = frm
        if to is not None:
            doc["to"] = to
        if self.revision is not None:
            doc["revision"] = self.revision
        if self.from_flags is not None:
            doc["fromFlags"] = self.from_flags.to_status()
        doc["toFlags"] = self.to_flags.to_status()
        return doc

    @classmethod
    def from_status(cls, doc: Any) -> Remediation | None:
        """Read a history item back (None when it is unreadable: status may be hand-edited)."""
        if not isinstance(doc, Mapping):
            return None
        t = parse_iso(doc.get("time"))
        if t is None:
            return None
        action = _FROM_STATUS_ACTIONS.get(str(doc.get("action")), str(doc.get("action") or ""))
        lever = doc.get("lever") if doc.get("lever") in (*LEVERS, *MEASURED_LEVERS) else None
        phase = doc.get("phase")
        field = LEVER_FIELDS.get(lever or "", "kv_cache_memory_bytes")
        # another lever's from/to are its own values, never a budget or a limit
        lever_value = field != "kv_cache_memory_bytes"
        frm = ServingFlags.from_status(doc.get("fromFlags")) or (
            _lever_flags(field, doc.get("from")) if lever_value else _flags_from_scalar(doc.get("from"))
        )
        to = (
            ServingFlags.from_status(doc.get("toFlags"))
            or (_lever_flags(field, doc.get("to")) if lever_value else _flags_from_scalar(doc.get("to")))
            or ServingFlags()
        )
        rank = doc.get("rank")
        pod, group = doc.get("pod"), doc.get("group")
        revision = doc.get("revision")
        return cls(
            time=t,
            trigger=str(doc.get("trigger") or ""),
            action=action,
            rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
            from_flags=frm,
            to_flags=to,
            revision=revision
            if isinstance(revision, (str, int)) and not isinstance(revision, bool)
            else None,
            message=str(doc.get("message") or ""),
            phase=phase if isinstance(phase, str) and phase else None,
            lever=lever,
            lever_from=_lever_value(doc.get("from")) if lever_value else None,
            pod=pod if isinstance(pod, str) and pod else None,
            group=group if isinstance(group, int) and not isinstance(group, bool) and group >= 0 else None,
        )


def _scalar(flags: ServingFlags | None, limit: bool) -> int | str | None:
    if flags is None:
        return None
    if limit:
        return None if flags.memory_limit_bytes is None else format_quantity(flags.memory_limit_bytes)
    if flags.kv_cache_memory_bytes is not None:
        return flags.kv_cache_memory_bytes
    if flags.gpu_memory_utilization is not None:
        return f"util={flags.gpu_memory_utilization!r}"
    return None


def _lever_scalar(v: int | bool | None) -> int | str | None:
    """A lever's value as the CRD's int-or-string from/to hold it (a switch as "true"/"false")."""
    if v is None:
        return None
    return str(v).lower() if isinstance(v, bool) else v


def _lever_value(v: Any) -> int | bool | None:
    if isinstance(v, str) and v in ("true", "false"):
        return v == "true"
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    return None


def _lever_flags(field: str, v: Any) -> ServingFlags | None:
    """Flags with only `field` set from a lever's scalar (an item written without fromFlags/toFlags)."""
    value = _lever_value(v)
    if value is None or isinstance(value, bool) != (field == "enforce_eager"):
        return None
    kw: dict[str, Any] = {field: value}
    return ServingFlags(**kw)


def _flags_from_scalar(v: Any) -> ServingFlags | None:
    try:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return ServingFlags(kv_cache_memory_bytes=v)
        if isinstance(v, str) and v.startswith("util="):
            return ServingFlags(gpu_memory_utilization=float(v[5:]))
        if isinstance(v, str) and v:
            return ServingFlags(memory_limit_bytes=parse_bytes(v))
    except (ValueError, QuantityError):
        return None
    return None


def history_from_status(items: Any) -> list[Remediation]:
    """`.status.remediations` -> Remediation list (unreadable items skipped), oldest first."""
    if not isinstance(items, list):
        return []
    out = [r for r in (Remediation.from_status(i) for i in items) if r is not None]
    return sorted(out, key=lambda r: r.time)
