"""Runs one LLMService's passes: gather the world, call the pure step, carry out its effects.

Everything decided lives in `core.reconcile.step`; this module only does I/O, in the order
the step lists its effects (intent before roll, roll before status), so a crash anywhere
leaves a state the next step finishes exactly once.

The state a step starts from is the status the API server holds. kopf hands the daemon a
live body, but the watch event of our own status write can arrive after the next pass has
started (a pod event wakes it at once, and kopf restarts a failed daemon after a short
delay). A step started from such a stale body would decide again what is already written
(and roll twice), so the executor remembers the state each of its writes left and the
resourceVersion the write returned, and uses that state until the body has caught up.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import kopf

from rankguard_operator.core import pod_world, reconcile
from rankguard_operator.core.conditions import Condition, Phase, set_condition
from rankguard_operator.core.model_source import ConfigRead, config_from_configmap
from rankguard_operator.core.status import status_patch
from rankguard_operator.edge import k8s
from rankguard_operator.edge.metrics import (
    AGENTS_UNAVAILABLE,
    ENGINE_RULES_FALLBACK,
    PASSES,
    RECONCILE_SECONDS,
    REMEDIATIONS,
)
from rankguard_operator.edge.scrape import Scraper, Target

log = logging.getLogger("rankguard_operator.executor")

# A state that lasts (a hold, Degraded, an invalid spec) is re-decided every pass; its Event
# is posted again at most this often (its text carries counters that change every second).
EVENT_REPEAT_SECONDS = 300.0
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
            except kopf.TemporaryError as e:
                log.debug("reading Node %s: %s", name, e)
                continue
            raw = ((node or {}).get("metadata") or {}).get("labels") or {}
            self._read[name] = (now, {str(k): str(v) for k, v in raw.items()})
        return {n: self._read[n][1] for n in names if n in self._read}


# One cache for the operator: many services run on the same GPU nodes.
NODE_LABELS = NodeLabels()


class ServiceExecutor:
    """One per LLMService, kept in kopf's per-object memo across daemon restarts."""

    def __init__(self, name: str, namespace: str, settings: reconcile.Settings) -> None:
        self.name, self.namespace, self.settings = name, namespace, settings
        self.scraper = Scraper(name, namespace)
        self.nodes = NODE_LABELS
        self._posted: dict[str, float] = {}  # Event reason -> when it was last posted
        self._written: tuple[str, reconcile.ServiceState] | None = None  # (rv of our write, state)
        self._refused: str | None = None  # the last refusal logged, so it is logged once

    async def close(self) -> None:
        await self.scraper.close()

    def forget(self) -> None:
        """The LLMService is gone (or the operator stops): drop its gauges, so a deleted
        service does not report agents unavailable forever."""
        for gauge in (AGENTS_UNAVAILABLE, ENGINE_RULES_FALLBACK):
            with contextlib.suppress(KeyError):
                gauge.remove(self.namespace, self.name)

    # ------------------------------------------------------------------------------- a pass
    async def run_once(self, body: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> str:
        """One pass. Returns the phase written (for the caller's logs)."""
        started = time.monotonic()
        try:
            return await self._run_once(body, pods)
        finally:
            RECONCILE_SECONDS.observe(time.monotonic() - started)
            PASSES.labels(namespace=self.namespace, llmservice=self.name).inc()

    def _state(self, body: Mapping[str, Any]) -> reconcile.ServiceState:
        rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        if self._written is not None and _older(rv, self._written[0]):
            return self._written[1]  # kopf has not delivered our own last write yet
        return reconcile.ServiceState.from_status(body.get("status"))

    def _remember(self, rv: str | None, state: reconcile.ServiceState) -> None:
        if rv is not None:
            self._written = (rv, state)

    async def _run_once(self, body: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> str:
        meta = body.get("metadata") or {}
        state = self._state(body)
        spec = dict(body.get("spec") or {})
        deployment = await k8s.get_deployment(self.namespace, self.name)
        model_config = await self._model_config(spec)
        reads = pod_world.reads(spec, self.name, pods)
        claim = await k8s.get_claim(self.namespace, reads.claim) if reads.claim else None
        targets = [Target(*t) for t in reconcile.scrape_targets(spec, deployment, pods)]
        scraped = await self.scraper.scrape(targets)
        world = reconcile.World(
            name=self.name,
            namespace=self.namespace,
            uid=str(meta.get("uid") or ""),
            generation=int(meta.get("generation") or 0),
            spec=spec,
            now=time.time(),
            new_id=uuid.uuid4().hex[:12],
            deployment=deployment,
            pods=pods,
            reports=[(s.pod, s.report, s.received_at) for s in scraped.reports],
            model_config=model_config,
            cache_claim=claim,
            agent_misses=scraped.misses,
            node_labels=await self.nodes.labels(reads.nodes),
        )
        step = reconcile.step(state, world, self.settings)
        AGENTS_UNAVAILABLE.labels(namespace=world.namespace, llmservice=world.name).set(
            len(step.agents_unavailable)
        )
        rules = next(
            (c for c in step.state.raw.get("conditions") or [] if c.get("type") == "EngineRules"), None
        )
        if rules is not None:
            ENGINE_RULES_FALLBACK.labels(namespace=world.namespace, llmservice=world.name).set(
                0 if rules.get("status") == "True" else 1
            )
        try:
            await self.execute(body, state, step)
        except k8s.ApplyRefused as e:
            await self._refused_apply(body, state, world, e)
            return Phase.DEGRADED.value
        self._refused = None
        return step.phase

    async def _model_config(self, spec: Mapping[str, Any]) -> ConfigRead | None:
        """spec.model.configMap's config.json, read for this pass (None when the spec names none)."""
        ref = (spec.get("model") or {}).get("configMap") if isinstance(spec.get("model"), Mapping) else None
        if not isinstance(ref, Mapping) or not isinstance(ref.get("name"), str):
            return None
        name, key = ref["name"], str(ref.get("key") or "config.json")
        return config_from_configmap(await k8s.get_configmap(self.namespace, name), name, key)

    async def execute(
        self, body: Mapping[str, Any], state: reconcile.ServiceState, step: reconcile.Step
    ) -> None:
        """Carry out the step's effects in order; the first failure stops the rest (the next
        step starts from what was persisted)."""
        for effect in step.effects:
            if isinstance(effect, reconcile.WriteIntent):
                rv = await k8s.patch_status(
                    self.namespace, self.name, {"pendingRemediation": dict(effect.pending)}
                )
                self._remember(rv, reconcile.with_intent(state, effect.pending))
            elif isinstance(effect, reconcile.ApplyDeployment):
                await k8s.apply(effect.body)
                if effect.remediation_id is not None:
                    REMEDIATIONS.labels(
                        self.namespace, self.name, str(effect.action), str(effect.trigger)
                    ).inc()
            elif isinstance(effect, (reconcile.ApplyService, reconcile.ApplyClaim)):
                await k8s.apply(effect.body)
            elif isinstance(effect, reconcile.PostEvent):
                await self._event(body, effect)
            elif isinstance(effect, reconcile.WriteStatus):
                rv = await k8s.patch_status(self.namespace, self.name, effect.patch)
                self._remember(rv, step.state)

    async def _event(self, body: Mapping[str, Any], e: reconcile.PostEvent) -> None:
        now = time.monotonic()
        if e.repeat:
            last = self._posted.get(e.reason)
            if last is not None and now - last < EVENT_REPEAT_SECONDS:
                return
        self._posted[e.reason] = now
        await k8s.post_event(body, type=e.type, reason=e.reason, message=e.message, name=e.name)

    async def _refused_apply(
        self,
        body: Mapping[str, Any],
        state: reconcile.ServiceState,
        world: reconcile.World,
        err: k8s.ApplyRefused,
    ) -> None:
        """The API server refused what we rendered: retrying the same object cannot help. Say so
        on the LLMService (Degraded, one Event per reason and period) and in the log once per
        distinct refusal; a pending remediation stays written, to be finished once it can."""
        message = (
            f"{err}. rankguard keeps retrying; change the LLMService (or what refuses the object: "
            "an admission policy, a quota, the operator's permissions) to let it through"
        )
        if self._refused != message:
            self._refused = message
            log.warning("LLMService %s/%s: %s", self.namespace, self.name, message)
        when = reconcile.iso(world.now)
        conditions = set_condition(
            list(state.raw.get("conditions") or []),
            Condition.DEGRADED,
            "True",
            "ApplyRefused",
            message,
            when,
            world.generation,
        )
        patch = status_patch(state.raw, {"conditions": conditions, "phase": Phase.DEGRADED.value})
        if patch is not None:
            await k8s.patch_status(self.namespace, self.name, patch)
        await self._event(body, reconcile.PostEvent("Warning", "ApplyRefused", message, repeat=True))


def _older(rv: str, than: str) -> bool:
    """True when resourceVersion `rv` is older than `than`. The API calls resourceVersions
    opaque, but they are etcd revisions (increasing integers) in every Kubernetes; anything
    else compares as "not older", so the body wins and nothing is ever stuck on the cache."""
    try:
        return int(rv) < int(than)
    except ValueError:
        return False
