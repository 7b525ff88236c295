"""What a multi-node service's groups show: each group's two StatefulSets and its pods, and the
whole as a Deployment-shaped view the step reads like the single-pod Deployment (replicas are
groups; a group is ready when its leader is ready and every worker runs the same template).

A group is one engine: a restarted container never rejoins vLLM's rendezvous (it happens once,
at start-up), and a pod created to replace a lost one finds a leader that will never take it in.
So a group whose pods restarted, or whose members (the pods it was complete with, recorded per
StatefulSet generation in status.groups) are no longer all there, must be started again as a
whole (core/step/group_roll).

Under `workload: LeaderWorkerSet` the sets are LWS's: one leader StatefulSet for every group
(named as the LWS, its pod `<lws>-<group>` a group's leader) and one worker StatefulSet per group
(named as its leader pod), none carrying rankguard's group label; a pod's group and node rank are
LWS's own labels (`leaderworkerset.sigs.k8s.io/group-index`; the node rank, `…/worker-index`,
reaches vLLM through the downward API: render/leader_worker_set.node_rank_env). LWS restarts and
rolls those groups itself; rankguard only reads them.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.names import (
    GROUP_LABEL,
    LWS_GROUP_INDEX_LABEL,
    LWS_SET_NAME_LABEL,
    ROLE_LABEL,
    TEMPLATE_HASH_ANNOTATION,
    VLLM_CONTAINER,
)
from rankguard_operator.core.observe.pods import carried_template_hash, get_path, pod_ready

LEADER, WORKER = "leader", "worker"


def _int(v: Any, default: int = 0) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _controller_counts_none(sts: Mapping[str, Any] | None) -> bool:
    """The StatefulSet controller has seen the set's latest spec and counts no pod of it
    (`status.replicas` counts every pod it has, terminating ones too)."""
    if sts is None:
        return True
    observed = _int(get_path(sts, "status", "observedGeneration"), -1)
    return observed >= _int(get_path(sts, "metadata", "generation"), 0) and not _int(
        get_path(sts, "status", "replicas"), 0
    )


def _name(obj: Mapping[str, Any]) -> str:
    return str(get_path(obj, "metadata", "name") or "")


def _uid(obj: Mapping[str, Any]) -> str:
    return str(get_path(obj, "metadata", "uid") or "")


def _restarts(pod: Mapping[str, Any]) -> int:
    for cs in get_path(pod, "status", "containerStatuses") or []:
        if isinstance(cs, Mapping) and cs.get("name") == VLLM_CONTAINER:
            return _int(cs.get("restartCount"))
    return 0


def _running(pod: Mapping[str, Any]) -> bool:
    for cs in get_path(pod, "status", "containerStatuses") or []:
        if isinstance(cs, Mapping) and cs.get("name") == VLLM_CONTAINER:
            return isinstance(get_path(cs, "state", "running"), Mapping)
    return False


@dataclass(frozen=True)
class LiveGroup:
    """One group as the watches show it."""

    index: int
    size: int  # pods per group (spec.distributed.podsPerGroup)
    leader: Mapping[str, Any] | None = None  # the leader's StatefulSet
    workers: Mapping[str, Any] | None = None  # the workers' StatefulSet
    pods: tuple[Mapping[str, Any], ...] = ()

    @property
    def template_hash(self) -> str | None:
        """The template both sets hold; None when either is missing or they disagree."""
        if self.leader is None or self.workers is None:
            return None
        a = carried_template_hash(get_path(self.leader, "spec", "template"))
        b = carried_template_hash(get_path(self.workers, "spec", "template"))
        return a if a == b else None

    @property
    def split(self) -> bool:
        """Both sets exist but hold different templates, or one is at zero and the other not:
        a replace applied to one set and not (or not yet seen) on the other."""
        if self.leader is None or self.workers is None:
            return False
        leader_down = _int(get_path(self.leader, "spec", "replicas"), 1) == 0
        workers_down = _int(get_path(self.workers, "spec", "replicas"), 1) == 0
        return self.template_hash is None or leader_down != workers_down

    @property
    def generation(self) -> int:
        return _int(get_path(self.leader, "metadata", "generation"))

    @property
    def scaled_down(self) -> bool:
        """Both sets asked for no pods: the group is being started again."""
        return (
            _int(get_path(self.leader, "spec", "replicas"), 1) == 0
            and _int(get_path(self.workers, "spec", "replicas"), 1) == 0
        )

    @property
    def empty(self) -> bool:
        """No pod of the group is left, not even one terminating: none in the pod watch, and none
        in either set's own count for the scale-down its controller has seen. The pod watch alone
        can miss a pod the StatefulSet controller created from the old template just before the
        scale-down reached it; starting the group then would run two templates at once."""
        return not self.pods and all(_controller_counts_none(s) for s in (self.leader, self.workers))

    def live_pods(self, template_hash: str | None) -> list[Mapping[str, Any]]:
        return [
            p
            for p in self.pods
            if not get_path(p, "metadata", "deletionTimestamp") and carried_template_hash(p) == template_hash
        ]

    @property
    def complete(self) -> bool:
        """Every pod of the group exists, runs vLLM and carries the group's template."""
        pods = self.live_pods(self.template_hash)
        return self.template_hash is not None and len(pods) == self.size and all(_running(p) for p in pods)

    @property
    def ready(self) -> bool:
        """Complete, with a ready leader (its /health answers only when every node joined)."""
        if not self.complete:
            return False
        return any(
            get_path(p, "metadata", "labels", ROLE_LABEL) == LEADER and pod_ready(p)
            for p in self.live_pods(self.template_hash)
        )

    def members(self) -> dict[str, str]:
        """pod name -> uid of the group's pods of its template."""
        return {_name(p): _uid(p) for p in self.live_pods(self.template_hash)}

    def restarted(self) -> list[str]:
        """The pods of the group's template whose vLLM container restarted."""
        return [_name(p) for p in self.live_pods(self.template_hash) if _restarts(p) > 0]

    def lost(self, recorded: Mapping[str, Any] | None) -> list[str]:
        """Members recorded for this generation of the group that are gone or were replaced."""
        if not isinstance(recorded, Mapping) or _int(recorded.get("generation"), -1) != self.generation:
            return []
        now = self.members()
        was = recorded.get("pods") if isinstance(recorded.get("pods"), Mapping) else {}
        assert isinstance(was, Mapping)
        return sorted(name for name, uid in was.items() if now.get(name) != uid)


@dataclass(frozen=True)
class Groups:
    """Every group of the service by index, and the ones beyond the wanted count."""

    by_index: Mapping[int, LiveGroup] = field(default_factory=dict)

    def get(self, index: int) -> LiveGroup | None:
        return self.by_index.get(index)

    def index_of(self, pod_name: str) -> int | None:
        """The group whose pods include the one named `pod_name` (None: no group's)."""
        for i, g in self.by_index.items():
            if any(get_path(p, "metadata", "name") == pod_name for p in g.pods):
                return i
        return None


def _label_int(obj: Mapping[str, Any] | None, label: str) -> int | None:
    v = get_path(obj, "metadata", "labels", label)
    try:
        return int(v) if isinstance(v, str) and v.isascii() and v.isdigit() else None
    except ValueError:
        return None


def _group_of(obj: Mapping[str, Any]) -> int | None:
    """rankguard's group label, else LWS's group index (an LWS pod, a worker set of LWS)."""
    own = _label_int(obj, GROUP_LABEL)
    return own if own is not None else _label_int(obj, LWS_GROUP_INDEX_LABEL)


def _lws_leader_set(s: Mapping[str, Any]) -> bool:
    """LWS's leader StatefulSet: LWS's name label and no group index (that is a worker set's)."""
    labels = get_path(s, "metadata", "labels") or {}
    return LWS_SET_NAME_LABEL in labels and LWS_GROUP_INDEX_LABEL not in labels


def live_groups(
    statefulsets: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], size: int
) -> Groups:
    """Group the service's StatefulSets and (trusted) pods by their group label (LWS's own
    for a LeaderWorkerSet's: its one leader set is every group's leader set)."""
    sets: dict[int, dict[str, Mapping[str, Any]]] = {}
    shared_leader: Mapping[str, Any] | None = None
    for s in statefulsets:
        if _lws_leader_set(s):
            shared_leader = s
            continue
        i = _group_of(s)
        role = get_path(s, "metadata", "labels", ROLE_LABEL)
        if role is None and get_path(s, "metadata", "labels", LWS_SET_NAME_LABEL) is not None:
            role = WORKER  # LWS's worker set carries LWS's labels only
        if i is not None and role in (LEADER, WORKER):
            sets.setdefault(i, {})[str(role)] = s
    if shared_leader is not None:
        for i in range(_int(get_path(shared_leader, "spec", "replicas"))):
            sets.setdefault(i, {})
        for roles in sets.values():
            roles.setdefault(LEADER, shared_leader)
    members: dict[int, list[Mapping[str, Any]]] = {}
    for p in pods:
        i = _group_of(p)
        if i is not None:
            members.setdefault(i, []).append(p)
    out = {
        i: LiveGroup(
            i,
            size,
            leader=sets.get(i, {}).get(LEADER),
            workers=sets.get(i, {}).get(WORKER),
            pods=tuple(members.get(i, [])),
        )
        for i in sorted(set(sets) | set(members))
    }
    return Groups(out)


def group_view(groups: Groups, replicas: int) -> dict[str, Any] | None:
    """The groups as a Deployment-shaped document (core/observe/pods.rollout_state reads it):
    `spec.template`'s hash is the one every wanted group holds (none while they differ),
    `status` counts groups. `groups` lists each group's hash, for scrape targets. None when no
    group exists yet."""
    wanted = [groups.get(i) for i in range(replicas)]
    present = [g for g in wanted if g is not None and g.template_hash is not None]
    if not present and not groups.by_index:
        return None
    hashes = {g.template_hash for g in present}
    common = next(iter(hashes)) if len(hashes) == 1 and len(present) == replicas else None
    ready = sum(1 for g in present if g.ready)
    updated = sum(1 for g in present if common is not None and g.template_hash == common and g.complete)
    template: dict[str, Any] = {"metadata": {"annotations": {}}}
    if common is not None:
        template["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = common
    leader0 = wanted[0].leader if wanted and wanted[0] is not None else None
    annotations = dict(get_path(leader0, "metadata", "annotations") or {}) if leader0 is not None else {}
    return {
        "kind": "GroupSet",
        "metadata": {"generation": 1, "annotations": annotations},
        "spec": {"replicas": replicas, "template": template},
        "status": {
            "observedGeneration": 1,
            "replicas": len(present),
            "updatedReplicas": updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
        },
        "groups": [{"index": g.index, "hash": g.template_hash} for g in groups.by_index.values()],
    }
