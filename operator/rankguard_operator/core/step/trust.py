"""Which of the pods found by rankguard's labels a pass may listen to (core/observe/ownership),
and which it names as ignored, with what the edge remembers between passes as a value.

Ownership alone is decided from the objects of one pass; what this stage adds needs memory:
a pod whose ReplicaSet (or StatefulSet) the watch has not delivered yet is most likely ours a
moment early, so it is said to be ignored only once it stays unvouched for `UNVOUCHED_GRACE`;
each ignored pod is said once (while it exists); and a StatefulSet's earlier pod templates
still vouch for a group replace's old pods until they are gone. The edge keeps the `Memory`
this returns and hands it back next pass: after an operator restart it starts empty (a
replace's old pods are then not vouched for, docs/security.md).

Pure: no I/O, no clock (`now` is an argument).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.effects import PostEvent
from rankguard_operator.core.observe import ownership
from rankguard_operator.core.observe.pods import get_path

# A pod whose ReplicaSet (or our Deployment) the watches have not shown is normally one the
# watch is a moment behind on; one still unvouched for after this long is counted as ignored.
UNVOUCHED_GRACE = 30.0
# A StatefulSet's earlier pod templates whose pods still count (a group replace leaves one
# earlier template's pods terminating; a few more cover replaces applied in quick succession).
SET_TEMPLATES_KEPT = 4
_WAIT_FOR_WATCH = ("unknown-replicaset", "no-deployment", "unknown-statefulset")


@dataclass(frozen=True)
class Memory:
    """What trust remembers from one pass to the next (in the operator's memory only)."""

    said: frozenset[str] = frozenset()  # UIDs of pods already said to be ignored
    unvouched: Mapping[str, float] = field(default_factory=dict)  # pod UID -> first seen unvouched
    # StatefulSet UID -> fingerprints of the pod templates it carried, oldest first
    set_templates: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Distrusted:
    """A pod ignored for the first time: the edge counts it by `reason`, logs `message` and
    posts `event`."""

    reason: str
    message: str
    event: PostEvent


@dataclass(frozen=True)
class Trusted:
    pods: list[Mapping[str, Any]]  # the pods the pass listens to
    statefulsets: list[Mapping[str, Any]]  # the StatefulSets the LLMService controls
    newly_ignored: tuple[Distrusted, ...]
    memory: Memory


def trust(
    pods: Sequence[Mapping[str, Any]],
    replicasets: Mapping[str, ownership.ReplicaSetRef],
    deployment: Mapping[str, Any] | None,
    service_uid: str,
    *,
    statefulsets: Sequence[Mapping[str, Any]],
    memory: Memory,
    now: float,
) -> Trusted:
    """The pods of the owner chain and provenance (core/observe/ownership), and the ones to say
    are ignored now; `now` is a monotonic time, as `memory.unvouched` holds."""
    set_templates, earlier = _set_templates(statefulsets, memory.set_templates)
    trusted, ignored = ownership.trusted_pods(
        pods,
        replicasets,
        deployment,
        service_uid,
        statefulsets=statefulsets,
        earlier_set_templates=earlier,
    )
    said, unvouched = set(memory.said), dict(memory.unvouched)
    newly: list[Distrusted] = []
    for i in ignored:
        if i.uid in said:
            continue
        # most likely ours, with its owner a moment behind in the watch: not news yet
        if i.reason in _WAIT_FOR_WATCH and now - unvouched.setdefault(i.uid, now) < UNVOUCHED_GRACE:
            continue
        said.add(i.uid)
        newly.append(Distrusted(i.reason, ownership.ignored_message(i), ownership.ignored_event(i)))
    live = {str(get_path(p, "metadata", "uid") or "") for p in pods}
    said &= live
    kept = {u: t for u, t in unvouched.items() if u in live and u not in said}
    return Trusted(
        trusted,
        ownership.owned_statefulsets(statefulsets, service_uid),
        tuple(newly),
        Memory(frozenset(said), kept, set_templates),
    )


def _set_templates(
    statefulsets: Sequence[Mapping[str, Any]], before: Mapping[str, tuple[str, ...]]
) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(each set's templates with this pass's last, the last few kept; the templates each set
    carried before this pass)."""
    now: dict[str, tuple[str, ...]] = {}
    for s in statefulsets:
        uid, fingerprint = str(get_path(s, "metadata", "uid") or ""), ownership.statefulset_fingerprint(s)
        kept = tuple(f for f in before.get(uid, ()) if f != fingerprint)
        now[uid] = (*kept, fingerprint)[-SET_TEMPLATES_KEPT:]
    return now, {uid: before[uid] for uid in now if uid in before}
