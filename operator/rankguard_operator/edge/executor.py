"""Runs one LLMService's passes: gather the world, call the pure step, carry out its effects.

Everything decided lives in `core.step` (what to read, which pods to trust, the step, what to
say of a refused apply); this module only does I/O, in the order the step lists its effects
(intent before roll, roll before status), so a crash anywhere leaves a state the next step
finishes exactly once.

The state a step starts from is the status the API server holds. kopf hands the daemon a
live body, but the watch event of our own status write can arrive after the next pass has
started (a pod event wakes it at once, and kopf restarts a failed daemon after a short
delay). A step started from such a stale body would decide again what is already written
(and roll twice), so the executor remembers the state each of its writes left and the
resourceVersion the write returned, and uses that state until the body has caught up. The
same holds for the Deployment, read from kopf's watch: the object our own apply returned is
used until the watch has delivered it (or something newer).

Only pods whose owner chain leads to this LLMService's Deployment, and that their owner made
(name and pod template), are passed to the step (core/step/trust); the others are counted once
each in `rankguard_operator_pods_ignored_total`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kopf

from rankguard_operator.core.cadence import resync_in, resync_phase
from rankguard_operator.core.conditions import Phase
from rankguard_operator.core.effects import (
    ApplyClaim,
    ApplyDeployment,
    ApplyObject,
    ApplyService,
    DeleteObject,
    PostEvent,
    WriteIntent,
    WriteStatus,
)
from rankguard_operator.core.names import LWS_KIND, OWNER_KIND, lws_name, name_problem
from rankguard_operator.core.step import (
    ConfigRead,
    Memory,
    NameRivals,
    ReplicaSetRef,
    ServiceState,
    Settings,
    Step,
    World,
    claim_settled,
    config_from_configmap,
    controller_of,
    invalid_spec,
    needs,
    reads_leader_worker_set,
    reconcile,
    refused_apply,
    trust,
    with_intent,
)
from rankguard_operator.edge import k8s, live_owner
from rankguard_operator.edge.metrics import (
    AGENTS_UNAVAILABLE,
    ENGINE_RULES_FALLBACK,
    LAST_PASS,
    OOMS_OBSERVED,
    PASSES,
    PODS_IGNORED,
    RECONCILE_ERRORS,
    RECONCILE_SECONDS,
    REMEDIATIONS,
    SERVICE_GAUGES,
    forget_service,
)
from rankguard_operator.edge.packed import unpacked_deployment
from rankguard_operator.edge.reads import NODE_LABELS, KeptRead, WarningEvents, exists
from rankguard_operator.edge.report_feed import ReportFeed
from rankguard_operator.edge.scrape import Scraper, Target

log = logging.getLogger("rankguard_operator.executor")

# A state that lasts (a hold, Degraded, an invalid spec) is re-decided every pass; its Event
# is posted again at most this often (its text carries counters that change every second).
EVENT_REPEAT_SECONDS = 300.0
# How long the Deployment our own apply returned stands in for one the watch has not delivered
# (the watch is usually milliseconds behind; a Deployment deleted since is seen after this).
APPLIED_STANDS_SECONDS = 30.0
# A pass refused because another LLMService controls an object of the same name looks again
# this soon: the garbage collector removes a deleted service's objects within seconds.
OWNED_RETRY_SECONDS = 5.0


@dataclass(frozen=True)
class Seen:
    """What the watches hold for one LLMService at the start of a pass (edge/handlers indexes)."""

    body: Mapping[str, Any]
    pods: Sequence[Mapping[str, Any]]  # by rankguard's labels: not yet vouched for
    deployment: Mapping[str, Any] | None  # the Deployment named after the service, if watched
    # ReplicaSet UID -> its controller's UID, its name and its pod template's fingerprint
    replicaset_owner: Mapping[str, ReplicaSetRef]
    statefulsets: Sequence[Mapping[str, Any]] = ()  # by rankguard's labels (a multi-node service's groups)
    name_rivals: NameRivals | None = None  # other LLMServices on this one's names (the names index)


class ServiceExecutor:
    """One per LLMService, kept in kopf's per-object memo across daemon restarts."""

    def __init__(self, name: str, namespace: str, settings: Settings, poll_retry: float = 2.0) -> None:
        self.name, self.namespace, self.settings = name, namespace, settings
        self.scraper = Scraper(name, namespace)
        # the serving pods' agents, long-polled; `feed.wake` is set by the service's daemon
        self.feed = ReportFeed(self.scraper, settings.stale_after, poll_retry)
        self._status_written: float | None = None  # monotonic time of our last status write
        self.nodes = NODE_LABELS
        self.claims = KeptRead(lambda n: k8s.get_claim(namespace, n), lambda c: claim_settled(c, name))
        self.configs = KeptRead(lambda n: k8s.get_configmap(namespace, n), exists)
        self.events = WarningEvents(namespace)  # a stuck pod's (core/observe/pod_blockers)
        self._posted: dict[str, float] = {}  # Event reason -> when it was last posted
        self._written: tuple[str, ServiceState] | None = None  # (rv of our write, state)
        self._applied: tuple[float, dict[str, Any]] | None = None  # (when, our last applied Deployment)
        self._applied_sets: dict[str, tuple[float, dict[str, Any]]] = {}  # StatefulSets: name -> (when, body)
        self._refused: str | None = None  # the last refusal logged, so it is logged once
        self._trust = Memory()  # what deciding which pods to trust remembers (core/step/trust)
        self._ooms_counted: set[str] = set()  # keys of new memory terminations already counted
        # whether the last pass had something that changes without a watch event or an agent's
        # news: a remediation under way, pods starting on a node, an agent not answering
        # (handlers pick the cadence)
        self.busy = True
        self.due_in: float | None = None  # the step's own clock: pass again by then (seconds)
        self.phase = resync_phase(namespace, name)

    async def close(self) -> None:
        await self.feed.close()
        await self.scraper.close()

    def forget(self) -> None:
        """The LLMService is gone (or the operator stops): drop its series, so a deleted
        service does not report agents unavailable, or a phase, forever."""
        forget_service(self.namespace, self.name)

    # ------------------------------------------------------------------------------- a pass
    def next_pass_in(self, fast: float, slow: float, now: float) -> float:
        """Seconds from `now` (the monotonic time the pass started) until the next pass without
        a wake-up: `fast` while busy, else this service's next resync (core/cadence), and never
        later than a verdict the step said falls due."""
        interval = fast if self.busy else resync_in(now, slow, self.phase)
        return interval if self.due_in is None else min(interval, max(self.due_in, 0.0))

    async def run_once(self, seen: Seen) -> str:
        """One pass. Returns the phase written (for the caller's logs)."""
        started = time.monotonic()
        try:
            return await self._run_once(seen)
        except k8s.ServiceGone:
            raise  # not a failure: the loop ends (edge/handlers)
        except k8s.ApiUnavailable:
            self._failed("api-unavailable")
            raise
        except kopf.TemporaryError:
            self._failed("conflict")
            raise
        except Exception:
            self._failed("error")
            raise
        finally:
            RECONCILE_SECONDS.observe(time.monotonic() - started)
            PASSES.labels(namespace=self.namespace, llmservice=self.name).inc()
            LAST_PASS.labels(namespace=self.namespace, llmservice=self.name).set(time.time())

    def _failed(self, kind: str) -> None:
        RECONCILE_ERRORS.labels(namespace=self.namespace, llmservice=self.name, kind=kind).inc()

    def _state(self, body: Mapping[str, Any]) -> ServiceState:
        rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        if self._written is not None:
            if _older(rv, self._written[0]):
                return self._written[1]  # kopf has not delivered our own last write yet
            self._written = None  # caught up: the body says the same (and holds it once)
        return ServiceState.from_status(body.get("status"))

    def _remember(self, rv: str | None, state: ServiceState) -> None:
        if rv is not None:
            self._written = (rv, state)

    def _deployment(self, watched: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """The watched Deployment, unless the one our own apply returned is newer."""
        applied = self._applied
        if applied is not None:
            mine = applied[1]
            rv = str((mine.get("metadata") or {}).get("resourceVersion") or "")
            if watched is None:
                if time.monotonic() - applied[0] < APPLIED_STANDS_SECONDS:
                    return dict(mine)
            elif _older(str((watched.get("metadata") or {}).get("resourceVersion") or ""), rv):
                return dict(mine)
            else:
                self._applied = None  # the watch has caught up: no second copy to keep
        return unpacked_deployment(watched) if watched is not None else None

    def _statefulsets(self, watched: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The watched StatefulSets, each replaced by the one our own apply returned while the
        watch has not caught up with it (so a group roll is not decided twice from a stale set)."""
        out = {_meta(s, "name"): dict(s) for s in watched}
        now = time.monotonic()
        for name, (when, mine) in list(self._applied_sets.items()):
            live = out.get(name)
            if (live is None and now - when < APPLIED_STANDS_SECONDS) or (
                live is not None and _older(_meta(live, "resourceVersion"), _meta(mine, "resourceVersion"))
            ):
                out[name] = dict(mine)
            else:
                del self._applied_sets[name]
        return [out[n] for n in sorted(out)]

    async def _leader_worker_set(self, spec: Mapping[str, Any], state: ServiceState) -> dict[str, Any] | None:
        """The service's LeaderWorkerSet (the middle link of its pods' owner chain), read when its
        spec asks for one or status records one (core/step/keep: one gone is applied again, one
        no longer wanted deleted): LWS is an optional CRD, so it is not watched (no CRD, no LWS:
        None)."""
        if not reads_leader_worker_set(spec, state):
            return None
        return await k8s.get_object(LWS_KIND, lws_name(self.name), self.namespace)

    async def _run_once(self, seen: Seen) -> str:
        body = seen.body
        meta = body.get("metadata") or {}
        state = self._state(body)
        spec = dict(body.get("spec") or {})
        generation = int(meta.get("generation") or 0)
        uid = str(meta.get("uid") or "")
        deployment = self._deployment(seen.deployment)
        lws = await self._leader_worker_set(spec, state)
        trusted = trust(
            seen.pods,
            seen.replicaset_owner,
            deployment,
            uid,
            statefulsets=self._statefulsets(seen.statefulsets),
            memory=self._trust,
            now=time.monotonic(),
            wall=time.time(),
            leader_worker_set=lws,
        )
        self._trust = trusted.memory
        for ignored in trusted.newly_ignored:
            PODS_IGNORED.labels(namespace=self.namespace, llmservice=self.name, reason=ignored.reason).inc()
            log.warning("LLMService %s/%s: %s", self.namespace, self.name, ignored.message)
            await self._event(body, ignored.event)
        pods, owned_sets = trusted.pods, trusted.statefulsets
        wanted = needs(
            spec, self.name, deployment=deployment, pods=pods, statefulsets=owned_sets, now=time.time()
        )
        scraped = await self.feed.read([Target(*t) for t in wanted.targets])
        world = World(
            name=self.name,
            namespace=self.namespace,
            uid=uid,
            generation=generation,
            spec=spec,
            now=time.time(),
            new_id=uuid.uuid4().hex[:12],
            deployment=deployment,
            statefulsets=owned_sets,
            leader_worker_set=lws,
            pods=pods,
            counted_runs=trusted.counted_runs,
            reports=[(s.pod, s.report, s.received_at) for s in scraped.reports],
            model_config=await self._model_config(wanted.config_map, generation),
            cache_claim=await self.claims.get(wanted.claim, generation) if wanted.claim else None,
            agent_misses=scraped.misses,
            node_labels=await self.nodes.labels(wanted.nodes),
            events=await self.events.of(wanted.event_subjects),
            name_rivals=seen.name_rivals,
            status_age=None if self._status_written is None else time.monotonic() - self._status_written,
        )
        problem = name_problem(self.name)
        step = (
            invalid_spec(state, world, problem)
            if problem is not None
            else reconcile.step(state, world, self.settings, wanted.spec)
        )
        self.busy, self.due_in = step.busy, step.pass_again_after
        if step.spec is not None:
            self.feed.set_lines(wanted.lines)
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
        self._count_ooms(step)
        try:
            await self.execute(body, state, step)
        except k8s.ApplyRefused as e:
            self._failed("apply-refused")
            await self._refused_apply(body, state, world, e)
            return Phase.DEGRADED.value
        self._refused = None
        self._published(step)
        return step.phase

    def _published(self, step: Step) -> None:
        """The service's gauges from the status just written, and one log line when its phase
        changed (a warning when it became Degraded or Failed)."""
        SERVICE_GAUGES.set(self.namespace, self.name, step.figures())
        change = step.phase_change()
        if change is not None:
            bad = step.phase in (Phase.DEGRADED.value, Phase.FAILED.value)
            log.log(
                logging.WARNING if bad else logging.INFO,
                "LLMService %s/%s: %s",
                self.namespace,
                self.name,
                change,
            )

    def _count_ooms(self, step: Step) -> None:
        """Count each memory termination once, acted upon or not. The step lists those not yet
        in status.handledTerminations (so a restarted operator does not count them again); one
        the policy left unhandled is listed again next pass, and is remembered here until then."""
        fresh = step.ooms()
        for t in fresh:
            if t.key not in self._ooms_counted:
                OOMS_OBSERVED.labels(
                    namespace=self.namespace, llmservice=self.name, reason=t.kind, rank=t.rank
                ).inc()
        self._ooms_counted = {t.key for t in fresh}

    async def _model_config(self, ref: tuple[str, str] | None, generation: int) -> ConfigRead | None:
        """spec.model.configMap's config.json (None when the spec names none)."""
        if ref is None:
            return None
        name, key = ref
        return config_from_configmap(await self.configs.get(name, generation), name, key)

    async def execute(self, body: Mapping[str, Any], state: ServiceState, step: Step) -> None:
        """Carry out the step's effects in order; the first failure stops the rest (the next
        step starts from what was persisted)."""
        for effect in step.effects:
            if isinstance(effect, WriteIntent):
                rv = await k8s.patch_status(
                    self.namespace, self.name, {"pendingRemediation": dict(effect.pending)}
                )
                self._remember(rv, with_intent(state, effect.pending))
            elif isinstance(effect, ApplyDeployment):
                self._applied = (time.monotonic(), await live_owner.apply(effect.body))
                if effect.remediation_id is not None:
                    REMEDIATIONS.labels(
                        self.namespace, self.name, str(effect.action), str(effect.trigger)
                    ).inc()
            elif isinstance(effect, ApplyObject):
                stored = await live_owner.apply(effect.body)
                if stored.get("kind") == "StatefulSet":
                    self._applied_sets[str(stored["metadata"]["name"])] = (time.monotonic(), stored)
            elif isinstance(effect, DeleteObject):
                await self._delete(effect, str((body.get("metadata") or {}).get("uid") or ""))
            elif isinstance(effect, (ApplyService, ApplyClaim)):
                await live_owner.apply(effect.body)
            elif isinstance(effect, PostEvent):
                await self._event(body, effect)
            elif isinstance(effect, WriteStatus):
                rv = await k8s.patch_status(self.namespace, self.name, effect.patch)
                self._status_written = time.monotonic()
                self._remember(rv, step.state)

    async def _delete(self, effect: DeleteObject, uid: str) -> None:
        """Delete what the step no longer wants, read first: only an object this LLMService
        controls (by UID) goes, and only that very object (a UID precondition, so one re-created
        in between under the same name stays). One already gone is fine."""
        self._applied_sets.pop(effect.name, None)
        if effect.kind == "Deployment":
            self._applied = None  # our last apply no longer stands in for the watch's view
        live = await k8s.get_object(effect.kind, effect.name, effect.namespace)
        if live is None:
            return
        meta = live.get("metadata") or {}
        if not uid or controller_of(live) != (OWNER_KIND, uid):
            log.info(
                "LLMService %s/%s: not deleting %s %s: another controller owns it",
                self.namespace,
                self.name,
                effect.kind,
                effect.name,
            )
            return
        await k8s.delete(effect.kind, effect.name, effect.namespace, uid=str(meta.get("uid") or ""))

    async def _event(self, body: Mapping[str, Any], e: PostEvent) -> None:
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
        state: ServiceState,
        world: World,
        err: k8s.ApplyRefused,
    ) -> None:
        """The API server refused what we rendered: retrying the same object cannot help
        (core/step/refusals says so on the LLMService); logged once per distinct refusal."""
        message = f"{err}. {err.advice}"
        if isinstance(err, live_owner.OwnedElsewhere):
            # the other service may be going, its objects with it: look again soon
            self.due_in = min(self.due_in or OWNED_RETRY_SECONDS, OWNED_RETRY_SECONDS)
        if self._refused != message:
            self._refused = message
            log.warning("LLMService %s/%s: %s", self.namespace, self.name, message)
        for effect in refused_apply(state, world, err.reason, message):
            if isinstance(effect, WriteStatus):
                await k8s.patch_status(self.namespace, self.name, effect.patch)
            elif isinstance(effect, PostEvent):
                await self._event(body, effect)


def _older(rv: str, than: str) -> bool:
    """True when resourceVersion `rv` is older than `than`. The API calls resourceVersions
    opaque, but they are etcd revisions (increasing integers) in every Kubernetes; anything
    else compares as "not older", so the body wins and nothing is ever stuck on the cache."""
    try:
        return int(rv) < int(than)
    except ValueError:
        return False


def _meta(obj: Mapping[str, Any], key: str) -> str:
    return str((obj.get("metadata") or {}).get(key) or "")
