"""Before an apply: is the live object of that name another LLMService's?

Two LLMServices can derive one object name (a long name shortened with a hash, a multi-node
service's `<base>-nodes`): the names index refuses the younger (core/render/taken_names), but
the index may lag, or the older one's spec may change onto names the younger already holds.
Server-side apply with force would take the object over: two services on one Service, and one's
deletion taking the other's. So every apply reads the live object first (one GET; applies are
rare: a roll, a spec change) and refuses when its controller is an LLMService of another name.

I/O edge: the only calls are through edge/k8s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rankguard_operator.core.names import OWNER_KIND
from rankguard_operator.edge import k8s


class OwnedElsewhere(k8s.ApplyRefused):
    """The live object is controlled by another LLMService: nothing is sent to the API server."""

    reason = "NameTaken"

    def __init__(self, kind: str, name: str, owner: str) -> None:
        Exception.__init__(
            self,
            f"{kind} {name} exists and its controller is LLMService {owner}: rankguard does not "
            "apply over another LLMService's object",
        )
        self.kind, self.name, self.status, self.detail, self.owner = kind, name, 0, "", owner
        self.advice = (
            "Two LLMServices whose names derive the same object name would share it: re-create this "
            f"one under another name, or delete {owner} (rankguard retries and proceeds once the "
            "object is gone)"
        )


def _controller(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((r for r in refs if isinstance(r, Mapping) and r.get("controller") is True), None)


def other_owner(rendered: Mapping[str, Any], live: Mapping[str, Any] | None) -> str | None:
    """The LLMService of another name that controls `live`, the object `rendered` would be
    applied over; None when there is none, it is ours, or it is no LLMService's. The same name
    is this service or its deleted predecessor, which the garbage collector is removing."""
    mine, theirs = _controller(rendered), _controller(live or {})
    if mine is None or theirs is None or theirs.get("kind") != OWNER_KIND:
        return None
    other = str(theirs.get("name") or "")
    return other if other != mine.get("name") else None


async def apply(obj: Mapping[str, Any]) -> dict[str, Any]:
    """k8s.apply, after checking the live object's controller: raises OwnedElsewhere (an
    ApplyRefused, so the executor says it on the LLMService) instead of taking it over."""
    meta = obj["metadata"]
    live = await k8s.get_object(obj["kind"], meta["name"], meta["namespace"])
    owner = other_owner(obj, live)
    if owner is not None:
        raise OwnedElsewhere(obj["kind"], meta["name"], owner)
    return await k8s.apply(obj)
