"""What a pass reads besides the watched objects, and how rarely: Node labels, the model cache's
claim, the ConfigMap holding a config.json, and the Warning Events of a stuck pod.

Deployments, ReplicaSets and pods come from kopf's watches (edge/handlers.py indexes), never
from a GET per pass: at a thousand LLMServices a GET per pass was 95 % of the operator's API
requests. These three are read one object at a time (the chart does not let the operator list
them: docs/rbac.md), so each is kept and read again only when it can have changed in a way
that matters: after a spec change, while it is not settled (a claim not yet Bound, a
ConfigMap missing), and otherwise at most every REREAD_SECONDS.

I/O edge: the only calls are through edge/k8s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import kopf

from rankguard_operator.edge import k8s

log = logging.getLogger("rankguard_operator.executor")

# A claim or ConfigMap that is settled is read again after this long (a person may resize a
# claim or edit a config.json; neither needs a faster answer than a minute).
REREAD_SECONDS = 60.0
# A node's labels are read again after this long (GPU Feature Discovery relabels rarely).
NODE_LABELS_SECONDS = 300.0


class NodeLabels:
    """The labels of the nodes serving pods run on, read one Node at a time and kept for
    NODE_LABELS_SECONDS (one instance, NODE_LABELS, for every LLMService). They only size the
    GPU before the agents have measured it, so no failure to read them stops a pass: a 403 (a
    namespaced install may not read Nodes, docs/rbac.md) is logged once per operator and
    retried after the same period; an API hiccup keeps what was read before."""

    forbidden_logged = False  # one log line per operator, not per LLMService

    def __init__(self) -> None:
        self._read: dict[str, tuple[float, dict[str, str]]] = {}
        self._forbidden_at: float | None = None

    async def labels(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        now = time.monotonic()
        # shared by every LLMService: a node read for one serves the others on it
        self._read = {n: v for n, v in self._read.items() if now - v[0] < NODE_LABELS_SECONDS}
        forbidden = self._forbidden_at is not None and now - self._forbidden_at < NODE_LABELS_SECONDS
        for name in names:
            kept = self._read.get(name)
            if forbidden or (kept is not None and now - kept[0] < NODE_LABELS_SECONDS):
                continue
            try:
                node = await k8s.get_node(name)
            except k8s.NodeForbidden as e:
                self._forbidden_at, forbidden = now, True
                if not NodeLabels.forbidden_logged:
                    NodeLabels.forbidden_logged = True
                    log.warning(
                        "cannot read Node %s (%s): GPU sizes come from the spec or the agents only; "
                        "grant `nodes get` (a cluster-wide install does) to plan from GPU Feature "
                        "Discovery labels before the first start",
                        name,
                        e,
                    )
                continue
            except (kopf.TemporaryError, k8s.ApiUnavailable) as e:
                log.debug("reading Node %s: %s", name, e)
                continue
            raw = ((node or {}).get("metadata") or {}).get("labels") or {}
            self._read[name] = (now, {str(k): str(v) for k, v in raw.items()})
        return {n: self._read[n][1] for n in names if n in self._read}


# One cache for the operator: many services run on the same GPU nodes.
NODE_LABELS = NodeLabels()


class KeptRead:
    """One object read through `read`, kept until the key (object name plus the spec generation)
    changes, the object is not settled, or REREAD_SECONDS pass."""

    def __init__(
        self,
        read: Callable[[str], Awaitable[dict[str, Any] | None]],
        settled: Callable[[dict[str, Any] | None], bool],
    ) -> None:
        self._read, self._settled = read, settled
        self._kept: tuple[tuple[str, int], float, dict[str, Any] | None] | None = None

    async def get(self, name: str, generation: int) -> dict[str, Any] | None:
        now = time.monotonic()
        kept = self._kept
        if (
            kept is not None
            and kept[0] == (name, generation)
            and self._settled(kept[2])
            and now - kept[1] < REREAD_SECONDS
        ):
            return kept[2]
        obj = await self._read(name)
        self._kept = ((name, generation), now, obj)
        return obj


# A stuck object's Warning Events are read again after this long (the kubelet retries a mount
# with back-off; a verdict a few seconds late costs nothing, a list per pass per pod would).
EVENTS_REREAD_SECONDS = 10.0


class WarningEvents:
    """The Warning Events of the objects a pass asks about (core/observe/pod_blockers'
    `event_subjects`: pods stuck before any container ran, StatefulSets short of pods), one
    list per object by field selector, kept EVENTS_REREAD_SECONDS; objects no longer asked
    about are forgotten. A read that fails keeps what was read before."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._kept: dict[str, tuple[float, list[dict[str, Any]]]] = {}

    async def of(self, uids: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
        now = time.monotonic()
        self._kept = {u: v for u, v in self._kept.items() if u in uids}
        for uid in uids:
            kept = self._kept.get(uid)
            if kept is not None and now - kept[0] < EVENTS_REREAD_SECONDS:
                continue
            try:
                self._kept[uid] = (now, await k8s.warning_events(self.namespace, uid))
            except (kopf.TemporaryError, k8s.ApiUnavailable) as e:
                log.debug("reading the Events of %s: %s", uid, e)
        return {u: v[1] for u, v in self._kept.items()}


def exists(obj: dict[str, Any] | None) -> bool:
    return obj is not None
