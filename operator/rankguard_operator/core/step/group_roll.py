"""A multi-node service's groups, moved one pass at a time toward what the step rendered.

A group is one vLLM engine over several pods, so it is started, restarted and rolled as one:

* **replace** = both of its StatefulSets applied with the wanted template at zero replicas;
  once none of its pods is left (not even a terminating one), both at full size. Its pods are
  created only when every old one is gone, so a group never runs two templates at once, and
  the sets' `OnDelete` strategy keeps the StatefulSet controller from replacing pods itself.
* **roll**: a group whose template is not the wanted one is replaced; a group that serves
  (ready) only when no other group is being started, so replicas roll one group at a time; a
  group that serves nothing already is replaced at once (as a Deployment replaces a crashing
  pod without waiting).
* **recreate**: a group of the wanted template whose vLLM container restarted, or whose
  recorded members are not all there (a pod deleted or evicted and re-created by its set), is
  replaced: the restarted or new process would wait forever for a rendezvous that is over.

Restart safety needs nothing written first: what to do is read from the sets and pods alone
(a group already at the wanted template is never replaced again for it), so an operator killed
in the middle of a roll carries on with the same roll. The members are kept per set generation
in status.groups: a replace changes the generation, so an old record never condemns new pods.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rankguard_operator.core.effects import ApplyObject, DeleteObject, Effect, PostEvent
from rankguard_operator.core.names import REMEDIATION_ID_ANNOTATION
from rankguard_operator.core.observe.groups import Groups, LiveGroup
from rankguard_operator.core.observe.pods import deployment_template_hash, get_path
from rankguard_operator.core.render.group import Group


@dataclass
class RollPlan:
    effects: list[Effect] = field(default_factory=list)
    members: dict[str, Any] = field(default_factory=dict)  # status.groups, by group index
    rolling: list[int] = field(default_factory=list)  # groups being started again this pass


def _stamp(body: Mapping[str, Any], annotations: Mapping[str, str]) -> dict[str, Any]:
    meta = dict(body["metadata"])
    if annotations:
        meta["annotations"] = dict(annotations)
    return {**body, "metadata": meta}


def _apply(plan: RollPlan, group: Group, *, up: bool, annotations: Mapping[str, str]) -> None:
    for body in group.scaled(up):
        plan.effects.append(ApplyObject(_stamp(body, annotations)))


def _same(live: Mapping[str, Any] | None, body: Mapping[str, Any]) -> bool:
    """The live set holds the body's template and replicas (nothing to apply)."""
    if live is None:
        return False
    return deployment_template_hash(live) == deployment_template_hash(body) and get_path(
        live, "spec", "replicas"
    ) == get_path(body, "spec", "replicas")


def plan_roll(
    want: Mapping[str, Any],
    groups: Groups,
    recorded: Mapping[str, Any],
    *,
    namespace: str,
) -> RollPlan:
    """This pass's applies and deletes toward `want` (render/group.render_group_set)."""
    plan = RollPlan()
    wanted: list[Group] = list(want.get("groups") or [])
    target = deployment_template_hash(want)
    annotations = {
        k: v
        for k, v in ((get_path(want, "metadata", "annotations") or {}).items())
        if k == REMEDIATION_ID_ANNOTATION
    }
    old: list[tuple[Group, LiveGroup]] = []
    busy = False  # a group of the wanted template is starting (or being started again)
    for g in wanted:
        live = groups.get(g.index)
        key = str(g.index)
        if live is None or live.leader is None or live.workers is None:
            _apply(plan, g, up=True, annotations=annotations)  # a new group: all its pods at once
            busy = True
            continue
        if live.split:
            # its two sets disagree: a replace half applied (or half seen yet): finish it, and
            # count the group as starting, so no serving group goes down beside it
            _apply(plan, g, up=False, annotations=annotations)
            busy = True
            continue
        if live.template_hash != target:
            old.append((g, live))
            continue
        if live.scaled_down:
            busy = True
            if live.empty:
                _apply(plan, g, up=True, annotations=annotations)
            continue
        if not all(_same(s, b) for s, b in zip((live.leader, live.workers), g.scaled(True), strict=True)):
            _apply(plan, g, up=True, annotations=annotations)  # replicas edited by hand
        why = _recreate_reason(live, recorded.get(key))
        if why:
            _apply(plan, g, up=False, annotations=annotations)
            plan.rolling.append(g.index)
            plan.effects.append(
                PostEvent(
                    "Warning",
                    "GroupRecreated",
                    f"group {g.index} is started again as a whole: {why}; a vLLM process that restarts "
                    "cannot rejoin its group's rendezvous",
                    repeat=False,
                )
            )
            busy = True
            continue
        if live.complete:
            rec = recorded.get(key)
            if isinstance(rec, Mapping) and rec.get("generation") == live.generation:
                plan.members[key] = dict(rec)
            else:
                plan.members[key] = {"generation": live.generation, "pods": live.members()}
        if not live.ready:
            busy = True
    for g, live in sorted(old, key=lambda gl: gl[1].ready):  # the groups serving nothing first
        if live.ready and busy:
            continue  # serving: wait until no other group is starting
        _apply(plan, g, up=False, annotations=annotations)
        plan.rolling.append(g.index)
        busy = True  # a serving group waits for every group being started
    for index, live in groups.by_index.items():
        if index >= len(wanted):
            for s in (live.leader, live.workers):
                if s is not None:
                    plan.effects.append(
                        DeleteObject("StatefulSet", str(get_path(s, "metadata", "name")), namespace)
                    )
    return plan


def _recreate_reason(live: LiveGroup, recorded: Any) -> str:
    restarted = live.restarted()
    if restarted:
        return f"vLLM restarted in {', '.join(restarted)}"
    lost = live.lost(recorded)
    if lost:
        return f"{', '.join(lost)} was lost and re-created"
    return ""
