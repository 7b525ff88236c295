"""Which of the pods found by rankguard's labels a pass may listen to (core/observe/ownership),
and which it names as ignored, with what the edge remembers between passes as a value.

Ownership alone is decided from the objects of one pass; what this stage adds needs memory:
a pod whose ReplicaSet (or StatefulSet) the watch has not delivered yet is most likely ours a
moment early, so it is said to be ignored only once it stays unvouched for `UNVOUCHED_GRACE`;
each ignored pod is said once (while it exists); and a StatefulSet's earlier pod templates
still vouch for a group replace's old pods until they are gone.

And a termination record counts only from a pod that passed the chain (owner and provenance)
before the run ended: trust remembers, per pod, the first run of its vllm container that had
not ended when it first saw the pod trusted (`Memory.counted_from`), and the step reads no
earlier run's end (core/observe/pods.new_terminations). An orphan can write an OOM record, go
Failed (or be deleted, held by a finalizer), and be patched to name the real ReplicaSet
afterwards; only the spec is immutable, and a record written before the pod was anyone's is
not its owner's evidence.

The edge keeps the `Memory` this returns and hands it back next pass: after an operator
restart it starts empty. Then a replace's old pods are not vouched for, and the termination
rule cannot be applied to pods made before the new operator's first pass over the service
(`Memory.since`): their ended runs count while they run on as their owner's (crash-looping,
the record in lastState, so a restart between an OOM and its remediation loses nothing), and
never once they are Failed or being deleted (`_first_counted`). A pod made after the first
pass is held to the rule.

Pure: no I/O, no clock (`now` is an argument).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.effects import PostEvent
from rankguard_operator.core.observe import ownership
from rankguard_operator.core.observe.pods import first_unended_run, get_path
from rankguard_operator.core.units import parse_iso

# A pod whose ReplicaSet (or our Deployment) the watches have not shown is normally one the
# watch is a moment behind on; one still unvouched for after this long is counted as ignored.
UNVOUCHED_GRACE = 30.0
# A StatefulSet's earlier pod templates whose pods still count (a group replace leaves one
# earlier template's pods terminating; a few more cover replaces applied in quick succession).
SET_TEMPLATES_KEPT = 4
# The API server's clock (creationTimestamp) against the operator's: a pod made this close to
# the first pass counts as made before it (the restart rule, _first_counted).
CLOCK_SKEW = 5.0
_WAIT_FOR_WATCH = ("unknown-replicaset", "no-deployment", "unknown-statefulset")


@dataclass(frozen=True)
class Memory:
    """What trust remembers from one pass to the next (in the operator's memory only)."""

    said: frozenset[str] = frozenset()  # UIDs of pods already said to be ignored
    unvouched: Mapping[str, float] = field(default_factory=dict)  # pod UID -> first seen unvouched
    # StatefulSet UID -> fingerprints of the pod templates it carried, oldest first
    set_templates: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # pod UID -> the first run of its vllm container whose end counts: the run that had not
    # ended when the pod was first seen trusted (while the pod exists)
    counted_from: Mapping[str, int] = field(default_factory=dict)
    # epoch seconds of this operator's first pass over the service: pods made since were seen
    # from their start; older ones were made while no operator (or another one) watched
    since: float | None = None
    # LeaderWorkerSet's StatefulSet UID -> the pod template specs it carried before its current
    # one, oldest first: LWS rolls a set's template while the old pods run on, and what its
    # webhook admits from a template depends on each pod (ownership.lws_admitted), so the specs
    # are kept, not fingerprints (a few KB per LWS set; only LWS's sets)
    set_specs: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)


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

    @property
    def counted_runs(self) -> Mapping[str, int]:
        """Pod UID -> the first run whose termination counts (World.counted_runs)."""
        return self.memory.counted_from


def trust(
    pods: Sequence[Mapping[str, Any]],
    replicasets: Mapping[str, ownership.ReplicaSetRef],
    deployment: Mapping[str, Any] | None,
    service_uid: str,
    *,
    statefulsets: Sequence[Mapping[str, Any]],
    memory: Memory,
    now: float,
    leader_worker_set: Mapping[str, Any] | None = None,
    wall: float | None = None,
) -> Trusted:
    """The pods of the owner chain and provenance (core/observe/ownership), and the ones to say
    are ignored now; `now` is a monotonic time, as `memory.unvouched` holds.
    `leader_worker_set`: the service's LeaderWorkerSet as the watch shows it (None when it has
    none): its StatefulSets, among `statefulsets`, vouch for pods through it. `wall`: the
    epoch time, which `memory.since` keeps from the first pass (None: every pod counts as made
    while this operator watched)."""
    set_templates, earlier = _set_templates(statefulsets, memory.set_templates)
    set_specs = _lws_set_specs(statefulsets, memory.set_specs)
    since = memory.since if memory.since is not None else wall
    trusted, ignored = ownership.trusted_pods(
        pods,
        replicasets,
        deployment,
        service_uid,
        statefulsets=statefulsets,
        earlier_set_templates=earlier,
        leader_worker_set=leader_worker_set,
        earlier_set_specs=memory.set_specs,
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
        ownership.owned_statefulsets(
            statefulsets, service_uid, leader_worker_set=leader_worker_set, pods=trusted
        ),
        tuple(newly),
        Memory(
            frozenset(said),
            kept,
            set_templates,
            _counted_from(trusted, memory.counted_from, live, since),
            set_specs=set_specs,
            since=since,
        ),
    )


def _counted_from(
    trusted: Sequence[Mapping[str, Any]], before: Mapping[str, int], live: set[str], since: float | None
) -> dict[str, int]:
    """Each trusted pod's first run whose end counts: kept from the pass that first trusted it,
    else `_first_counted` now."""
    out = {u: r for u, r in before.items() if u in live}
    for pod in trusted:
        uid = str(get_path(pod, "metadata", "uid") or "")
        if uid and uid not in out:
            out[uid] = _first_counted(pod, since)
    return out


def _first_counted(pod: Mapping[str, Any], since: float | None) -> int:
    """A pod first seen trusted: the first run whose end counts. A pod made while this operator
    watched the service was seen from its start (its owner's watch event wakes the loop), so a
    run that had ended before it was first trusted was not its owner's: an orphan can write an
    OOM record and be handed to the real ReplicaSet afterwards (issue 50). A pod made before
    (the operator restarted) cannot be told apart so: its ended runs count while it runs on as
    its owner's (crash-looping, the record in lastState: a restart between an OOM and its
    remediation must not lose it), and never once it is Failed or being deleted (the forged
    pod lingers so, held by a finalizer; a real one that ended so is gone from the rollout)."""
    created = parse_iso(get_path(pod, "metadata", "creationTimestamp"))
    watched_from_start = since is None or created is None or created > since + CLOCK_SKEW
    ended = bool(get_path(pod, "metadata", "deletionTimestamp")) or get_path(pod, "status", "phase") in (
        "Failed",
        "Succeeded",
    )
    return first_unended_run(pod) if watched_from_start or ended else 0


def _lws_set_specs(
    statefulsets: Sequence[Mapping[str, Any]], before: Mapping[str, tuple[Mapping[str, Any], ...]]
) -> dict[str, tuple[Mapping[str, Any], ...]]:
    """Each LWS StatefulSet's earlier pod template specs, this pass's current one added for the
    next pass (it is the set's own now; it becomes earlier once LWS changes it), a few kept."""
    now: dict[str, tuple[Mapping[str, Any], ...]] = {}
    for s in statefulsets:
        owner = ownership.controller_of(s)
        spec = get_path(s, "spec", "template", "spec")
        if owner is None or owner[0] not in ("LeaderWorkerSet", "Pod") or not isinstance(spec, Mapping):
            continue
        uid = str(get_path(s, "metadata", "uid") or "")
        kept = tuple(t for t in before.get(uid, ()) if t != spec)
        now[uid] = (*kept, spec)[-SET_TEMPLATES_KEPT:]
    return now


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
