"""The object names an LLMService's render takes, and which of them an older LLMService holds.

A name too long for a label or a Service is shortened to a prefix plus a hash (core/names), and
a multi-node service derives more names from its own (`<base>-g<i>`, `<base>-g<i>-w`,
`<base>-nodes`; a LeaderWorkerSet's `<lws>`, `<lws>-<i>`). Another LLMService may take any of
those as its literal name: a 70-character name and a second service named with its 63-character
label value share one label, one selector and one Service, and each endpoint serves either
model. The label scheme cannot change (a Deployment's selector is immutable), so the collision
is refused instead: of the LLMServices in a namespace that take one name, the oldest (by
creationTimestamp, then name) keeps it, and each younger one applies nothing and says why
(Degraded NameTaken). The verdict depends only on the LLMServices, not on which pass runs first.

The edge keeps every LLMService's names in a kopf index (`held_names`, keyed by namespace, kind
and name) and hands a pass the other holders of its own names (`NameRivals`); `taken` decides.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rankguard_operator.core.names import (
    LWS_KIND,
    cache_claim_name,
    group_leader_name,
    group_service_name,
    group_workers_name,
    label_value,
    lws_name,
    service_name,
)
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec

LABEL = "label"  # the kind of a label value (the selector every pod lookup uses), not an object
NameKey = tuple[str, str]  # (kind, name): one name an LLMService's render takes

_WHAT = {
    LABEL: "pod label value (rankguard.io/llmservice, the selector of its pods and Service)",
    "Service": "Service name",
    "StatefulSet": "StatefulSet name",
    LWS_KIND: "LeaderWorkerSet name",
    "PersistentVolumeClaim": "model cache claim name",
}


def held_names(name: str, spec: Mapping[str, Any]) -> frozenset[NameKey]:
    """Every name the LLMService `name` takes with `spec` (as stored). A Deployment is named
    after the LLMService itself, which no other LLMService in the namespace can be, so it is
    not listed. A spec that cannot be read takes the names every service takes (label and
    Service); its other names come once it can be served."""
    keys: set[NameKey] = {(LABEL, label_value(name)), ("Service", service_name(name))}
    try:
        s = parse_spec(spec)
    except SpecError:
        return frozenset(keys)
    if s.model_cache is not None and s.model_cache.created:
        keys.add(("PersistentVolumeClaim", cache_claim_name(name)))
    d = s.distributed
    if d is None:
        return frozenset(keys)
    if d.workload == "StatefulSet":
        keys.add(("Service", group_service_name(name)))
        for i in range(s.replicas):
            keys |= {
                ("StatefulSet", group_leader_name(name, i)),
                ("StatefulSet", group_workers_name(name, i)),
            }
    else:
        # LWS names the leaders' StatefulSet after itself, and each group's workers' StatefulSet
        # and headless Service `<lws>-<group>` (render/leader_worker_set)
        lws = lws_name(name)
        keys |= {(LWS_KIND, lws), ("StatefulSet", lws)}
        for i in range(s.replicas):
            keys |= {("StatefulSet", f"{lws}-{i}"), ("Service", f"{lws}-{i}")}
    return frozenset(keys)


@dataclass(frozen=True)
class Holder:
    """One LLMService as the names index keeps it: no more than the verdict needs."""

    name: str
    uid: str
    created: str  # metadata.creationTimestamp (RFC 3339 in UTC: one format, so it orders as text)


@dataclass(frozen=True)
class Rival:
    """Another LLMService that takes one of this one's names."""

    kind: str
    value: str
    holder: Holder


@dataclass(frozen=True)
class NameRivals:
    """What a pass knows of its names: its own creationTimestamp and the other holders."""

    created: str
    rivals: Sequence[Rival] = ()


def taken(name: str, names: NameRivals | None) -> Rival | None:
    """The older LLMService that keeps one of `name`'s names (the oldest, if several), or None
    when this one is the oldest holder of each of its names."""
    if names is None:
        return None
    me = (names.created, name)
    older = [r for r in names.rivals if r.holder.name != name and (r.holder.created, r.holder.name) < me]
    return min(older, key=lambda r: (r.holder.created, r.holder.name, r.kind, r.value), default=None)


def taken_message(name: str, rival: Rival) -> str:
    """Degraded NameTaken's message: what is taken, by whom, and the way out."""
    what = _WHAT.get(rival.kind, f"{rival.kind} name")
    other = rival.holder
    shortened = (
        " (a name longer than a label or Service allows is shortened to a prefix and a hash of it, "
        "which another name can equal)"
        if rival.kind in (LABEL, "Service") and rival.value != name
        else ""
    )
    return (
        f"the {what} {rival.value!r} that LLMService {name} would take is already LLMService "
        f"{other.name}'s (created {other.created}, before this one){shortened}; two services on one "
        f"name would share pods and endpoints. rankguard applies nothing for {name}: re-create it "
        f"under another name (or delete {other.name}, and {name} proceeds by itself)"
    )
