"""Which devices a process sees, in which order: CUDA's rules, as pure functions.

Rank i of the pod is device i as CUDA numbers it inside the engine, so the backends must
follow the same rules CUDA follows:

- NVIDIA_VISIBLE_DEVICES is read by the container runtime, which mounts the listed GPUs;
  NVML inside the container then sees only those. When the agent can still see more GPUs
  than listed (it runs outside such a runtime), the list is applied as a filter.
- CUDA_VISIBLE_DEVICES is applied by CUDA itself, on top: entries are indices (in CUDA's
  enumeration order) or UUIDs ("GPU-…", a unique prefix is enough, "MIG-…" for MIG
  instances). CUDA stops at the first entry it cannot resolve and ignores the rest, so
  "0,1,-1,2" means devices 0 and 1, and "" or "-1" mean none.
"""

from __future__ import annotations

from dataclasses import dataclass

# Values of NVIDIA_VISIBLE_DEVICES that name no specific device: the runtime decided.
_RUNTIME_KEYWORDS = {"", "all", "void", "none"}


@dataclass(frozen=True, slots=True)
class Target:
    """One visible device: an index into the candidate list, or a MIG instance by UUID."""

    index: int | None = None
    mig_uuid: str | None = None


@dataclass(frozen=True, slots=True)
class Selection:
    targets: list[Target]
    warning: str | None = None  # why some entries were dropped, to be logged once


def split_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",")]


def is_mig(entry: str) -> bool:
    return entry.upper().startswith("MIG-")


def _norm_uuid(value: str) -> str:
    v = value.strip().lower()
    return v if v.startswith(("gpu-", "mig-")) else "gpu-" + v


def _match_uuid(entry: str, uuids: list[str]) -> int | None:
    """Index of the one candidate whose UUID starts with `entry` ("GPU-" optional), else None."""
    want = _norm_uuid(entry)
    hits = [i for i, u in enumerate(uuids) if u and _norm_uuid(u).startswith(want)]
    return hits[0] if len(hits) == 1 else None


def apply_nvidia_visible(uuids: list[str], value: str | None) -> Selection:
    """Filter NVML's devices (PCI order) by NVIDIA_VISIBLE_DEVICES, keeping that order.

    Indices in this variable are host indices; if NVML already sees no more devices than
    listed, the runtime applied the list and the indices no longer mean anything here.
    """
    everything = Selection([Target(index=i) for i in range(len(uuids))])
    if value is None or value.strip().lower() in _RUNTIME_KEYWORDS:
        return everything
    entries = [e for e in split_list(value) if e]
    if any(is_mig(e) for e in entries):
        return Selection([Target(mig_uuid=e) for e in entries if is_mig(e)])
    if all(e.isdigit() for e in entries):
        if len(uuids) <= len(entries):
            return everything
        picked = sorted({int(e) for e in entries if int(e) < len(uuids)})
        return Selection([Target(index=i) for i in picked])
    picked_set: set[int] = set()
    unknown = []
    for e in entries:
        i = _match_uuid(e, uuids)
        if i is None:
            unknown.append(e)
        else:
            picked_set.add(i)
    if not picked_set:
        # Nothing matches: NVML sees other names than the runtime's (a remapped view);
        # trust what NVML shows rather than report no GPU at all.
        return Selection(
            everything.targets, f"NVIDIA_VISIBLE_DEVICES entries {unknown} match no GPU NVML sees"
        )
    warning = f"NVIDIA_VISIBLE_DEVICES entries {unknown} match no GPU NVML sees" if unknown else None
    return Selection([Target(index=i) for i in sorted(picked_set)], warning)


def apply_cuda_visible(uuids: list[str], value: str | None) -> Selection:
    """Apply CUDA_VISIBLE_DEVICES to candidates already in CUDA's enumeration order."""
    if value is None:
        return Selection([Target(index=i) for i in range(len(uuids))])
    targets: list[Target] = []
    seen: set[int | str] = set()
    for entry in split_list(value):
        idx: int | None
        if entry.lstrip("-").isdigit():
            idx = int(entry) if 0 <= int(entry) < len(uuids) else None
        else:
            idx = _match_uuid(entry, uuids) if entry else None
        key: int | str
        if idx is not None:
            key, target = idx, Target(index=idx)
        elif is_mig(entry):
            # A MIG instance the candidates do not list: the backend opens it by UUID.
            key, target = entry.upper(), Target(mig_uuid=entry)
        else:
            return Selection(targets, _stopped(value, entry, targets))
        if key in seen:
            return Selection(targets, _stopped(value, entry, targets))
        seen.add(key)
        targets.append(target)
    return Selection(targets)


def _stopped(value: str, entry: str, kept: list[Target]) -> str | None:
    if value.strip() in ("", "-1"):
        return None  # the usual way to hide every GPU; not worth a warning
    return f"CUDA_VISIBLE_DEVICES={value!r}: stopped at {entry!r} as CUDA does; {len(kept)} device(s) visible"
