"""Writing an LLMService's `.status` only when something changed, as JSON merge patches (RFC 7386).

* `status_patch`: the merge patch that turns the status as stored into the status a step built
  (None when they are equal), so a steady pass writes nothing.
* `merged_status`: the status as stored after such a patch of top-level fields lands, so the
  next step starts from what the API server holds without reading it back.
* `merge_patch`: RFC 7386 itself, as the API server applies a merge patch: for whoever replays
  the step's effects on objects in memory (`step.replay`).

Pure: no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def _diff(old: Mapping[str, Any], new: Mapping[str, Any], *, top: bool) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key, value in new.items():
        before = old.get(key)
        if value is None:
            if before is not None:
                patch[key] = None  # merge-patch null: remove the field
            continue
        if isinstance(value, Mapping) and isinstance(before, Mapping):
            sub = _diff(before, value, top=False)
            if sub:
                patch[key] = sub
        elif before != value:
            patch[key] = value
    if not top:
        # inside an object rankguard owns, fields it no longer writes are removed
        for key in old:
            if key not in new and old[key] is not None:
                patch[key] = None
    return patch


def status_patch(
    old_status: Mapping[str, Any] | None, new_status: Mapping[str, Any]
) -> dict[str, Any] | None:
    """A JSON merge patch (RFC 7386) turning `old_status` into `new_status`, or None when they
    are equal, so the caller writes status only on change. Top-level fields absent from
    `new_status` are left alone (they may belong to someone else, e.g. kopf); set one to None
    to remove it. Nested objects are diffed field by field; lists are replaced whole."""
    patch = _diff(old_status or {}, new_status, top=True)
    return patch or None


def merged_status(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`old` with the top-level fields of `new` written over it (None removes a field): the
    status as stored after a merge patch that rankguard built from `new`."""
    out = dict(old)
    for k, v in new.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


def merge_patch(target: Any, patch: Any) -> Any:
    """`patch` applied to `target` as RFC 7386 says (the API server's merge patch): objects
    merged key by key, null removes a key, anything else replaces. Neither input is changed."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
