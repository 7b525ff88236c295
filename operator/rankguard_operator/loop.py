"""One pass of an LLMService's loop: observe, decide (pure), act, report.

Restart safety: before a remediation rolls the Deployment, the decision is written to
`.status.pendingRemediation` with a fresh id; the roll stamps that id on the Deployment
(annotation `rankguard.io/remediation-id`). A restarted operator that finds a pending
remediation either sees the id on the Deployment (rolled: finish the bookkeeping) or not
(not rolled: roll now). Either way the Deployment rolls exactly once per decision.
Terminations are deduplicated by pod uid + container + restart count, kept in
`.status.handledTerminations`, so the same pod event delivered twice acts once.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import kopf

from . import k8s, observe, policy, render, status
from .budget import budget_key
from .flags import ServingFlags
from .headroom import aggregate
from .history import history_from_status
from .metrics import RECONCILE_SECONDS, REMEDIATIONS
from .scrape import Scraper, Target
from .spec import ServiceSpec, SpecError, parse_spec

log = logging.getLogger("rankguard_operator.loop")

REMEDIATION_ID = "rankguard.io/remediation-id"
HANDLED_LIMIT = 64
STALE_AFTER = float(os.environ.get("RANKGUARD_STALE_AFTER", "30"))
EVENT_REPEAT_SECONDS = 300.0
AGENT_IMAGE = os.environ.get("RANKGUARD_AGENT_IMAGE", "ghcr.io/rankguard/agent:0.1.0")


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ServiceLoop:
    def __init__(self, name: str, namespace: str, body: kopf.Body) -> None:
        self.name, self.namespace, self.body = name, namespace, body
        self.scraper = Scraper(name, namespace)
        self._posted: dict[str, float] = {}  # Event reason -> when it was last posted

    async def close(self) -> None:
        await self.scraper.close()

    # ------------------------------------------------------------------ helpers
    def _event(self, kind: str, reason: str, message: str, *, always: bool = False) -> None:
        """Post an Event. Reports that repeat every pass (a hold, a degraded state) are posted
        once per reason and EVENT_REPEAT_SECONDS, not once per pass: their text carries counters
        that change every second. A roll (`always`) is always its own Event."""
        now = time.monotonic()
        last = self._posted.get(reason)
        if not always and last is not None and now - last < EVENT_REPEAT_SECONDS:
            return
        self._posted[reason] = now
        kopf.event(self.body, type=kind, reason=reason, message=message[:1024])

    def _render(self, spec: ServiceSpec, flags: ServingFlags, remediation_id: str | None) -> dict[str, Any]:
        annotations = {REMEDIATION_ID: remediation_id} if remediation_id else {}
        uid = self.body["metadata"]["uid"]
        return render.render_deployment(
            self.name,
            self.namespace,
            uid,
            spec,
            flags,
            agent_image=AGENT_IMAGE,
            revision_annotations=annotations,
        )

    async def _roll(
        self, spec: ServiceSpec, flags: ServingFlags, remediation_id: str | None
    ) -> dict[str, Any]:
        return await k8s.apply(self._render(spec, flags, remediation_id))

    # --------------------------------------------------------------------- pass
    async def run_once(self, pods: Sequence[Mapping[str, Any]]) -> None:
        started = time.monotonic()
        try:
            await self._run_once(pods)
        finally:
            RECONCILE_SECONDS.observe(time.monotonic() - started)

    async def _run_once(self, pods: Sequence[Mapping[str, Any]]) -> None:
        now = time.time()
        body = self.body
        generation = int(body.get("metadata", {}).get("generation") or 0)
        old_status: dict[str, Any] = dict(body.get("status") or {})

        try:
            spec = parse_spec(dict(body.get("spec") or {}))
        except SpecError as e:
            await self._invalid(old_status, generation, now, str(e))
            return

        deployment = await k8s.get_deployment(self.namespace, self.name)
        current = ServingFlags.from_status(old_status.get("servingFlags"))
        lkg = ServingFlags.from_status(old_status.get("lastKnownGood"))
        handled: list[str] = list(old_status.get("handledTerminations") or [])
        history: list[dict[str, Any]] = list(old_status.get("remediations") or [])
        pending = old_status.get("pendingRemediation")
        updates: dict[str, Any] = {}

        # 1. Finish a remediation a previous pass decided (maybe before a restart): exactly once.
        if pending:
            target = ServingFlags.from_status(pending.get("toFlags"))
            rolled_id = ((deployment or {}).get("metadata", {}).get("annotations") or {}).get(REMEDIATION_ID)
            if target is not None and rolled_id != pending.get("id"):
                log.info(
                    "%s/%s: rolling pending remediation %s", self.namespace, self.name, pending.get("id")
                )
                deployment = await self._roll(spec, target, pending.get("id"))
                record = pending.get("record")
                if isinstance(record, dict) and not any(
                    h.get("revision") == pending.get("id") for h in history
                ):
                    # The pass that decided this died before recording it: record and announce now.
                    history = status.append_history(history, record)
                    self._event(
                        "Warning", "RemediationResumed", str(record.get("message") or ""), always=True
                    )
            current = target or current
            handled = _merge_keys(handled, pending.get("terminations") or [])
            updates["pendingRemediation"] = None

        # 2. Observe. Only pods of the template in effect speak for the current flags.
        current_hash = render.template_hash(self._render(spec, current, None)) if current else None
        ready_pods = [
            p
            for p in pods
            if observe.pod_ready(p) and observe.pod_ip(p) and observe.pod_template_hash(p) == current_hash
        ]
        scraped = await self.scraper.scrape(
            [Target(p["metadata"]["name"], str(observe.pod_ip(p)), spec.agent.port) for p in ready_pods]
        )
        observation = aggregate([(s.pod, s.report, s.received_at) for s in scraped], now, STALE_AFTER)
        fresh_terms = observe.new_terminations(pods, set(handled))
        rollout = observe.rollout_state(deployment, current_hash or "") if deployment else None
        low_since = policy.track_low_headroom(old_status.get("lowHeadroomSince"), observation, spec, now)
        ample_since = policy.track_ample_headroom(
            old_status.get("ampleHeadroomSince"), observation, spec, now
        )
        try:
            plan = policy.initial_plan(spec, observation)
        except SpecError as e:
            await self._invalid(old_status, generation, now, str(e))
            return

        decision = policy.decide(
            policy.PolicyInput(
                spec=spec,
                now=now,
                current=current,
                last_known_good=lkg,
                observation=observation,
                new_terminations=fresh_terms,
                rollout=rollout,
                history=history_from_status(history),
                plan=plan,
                low_headroom_since=low_since,
                ample_headroom_since=ample_since,
                budget_key=old_status.get("budgetKey") if current is not None else None,
            )
        )
        handled = _merge_keys(handled, decision.handled)

        # 3. Act.
        if current is None:
            current = decision.flags  # the first render: nothing to roll back from
            self._event("Normal", decision.reason, decision.message)
        elif decision.changes_flags:
            rid = uuid.uuid4().hex[:12]
            # Write the intent first: a crash between here and the roll is finished on restart.
            await k8s.patch_status(
                self.namespace,
                self.name,
                {
                    "pendingRemediation": {
                        "id": rid,
                        "kind": decision.action,
                        "startedAt": _iso(now),
                        "fromFlags": current.to_status(),
                        "toFlags": decision.flags.to_status(),
                        "terminations": list(decision.handled),
                        "record": decision.remediation(now, revision=rid).to_status()
                        if decision.is_remediation
                        else None,
                    }
                },
            )
            deployment = await self._roll(spec, decision.flags, rid)
            if decision.is_remediation:
                history = status.append_history(history, decision.remediation(now, revision=rid))
                REMEDIATIONS.labels(self.namespace, self.name, decision.action, decision.trigger).inc()
            kind = "Normal" if decision.action in ("grow", "replan") else "Warning"
            self._event(kind, decision.reason, decision.message, always=True)
            current = decision.flags
            updates["pendingRemediation"] = None
            # A new revision starts its own headroom clocks.
            low_since, ample_since = None, None
        elif decision.action in ("degrade", "hold") and decision.message:
            self._event("Warning", decision.reason, decision.message)

        # 4. Keep the Deployment and Service as rendered. Server-side apply is idempotent; the
        #    call is skipped when the live template already carries what we would render.
        want = self._render(spec, current, None)
        want_hash = render.template_hash(want)
        live_hash = observe.pod_template_hash((deployment or {}).get("spec", {}).get("template", {}))
        live_replicas = (deployment or {}).get("spec", {}).get("replicas")
        if deployment is None or live_hash != want_hash or live_replicas != spec.replicas:
            deployment = await self._roll(spec, current, None)
        rollout = observe.rollout_state(deployment, want_hash)
        if not old_status.get("serviceApplied") or generation != old_status.get("observedGeneration"):
            await k8s.apply(
                render.render_service(self.name, self.namespace, self.body["metadata"]["uid"], spec)
            )

        # 5. Report (written only when something changed).
        ready_replicas = int((deployment or {}).get("status", {}).get("readyReplicas") or 0)
        lkg = policy.next_last_known_good(
            lkg, current, spec=spec, rollout=rollout, observation=observation, terminations=fresh_terms
        )
        new_status = status.build_status(
            old=old_status,
            spec=spec,
            generation=generation,
            now_iso=_iso(now),
            observation=observation,
            flags=current,
            last_known_good=lkg,
            plan=plan,
            decision=decision,
            rollout=rollout,
            ready_replicas=ready_replicas,
            history=history,
        )
        new_status.update(updates)
        new_status.update(
            {
                "servingFlags": current.to_status(),
                "budgetKey": budget_key(spec),
                "handledTerminations": handled,
                "lowHeadroomSince": low_since,
                "ampleHeadroomSince": ample_since,
                "serviceApplied": True,
            }
        )
        await self._write_status(old_status, new_status)

    async def _invalid(
        self, old_status: Mapping[str, Any], generation: int, now: float, message: str
    ) -> None:
        """A spec rankguard cannot serve: say why on the object, once, and touch nothing else."""
        conditions = list(old_status.get("conditions") or [])
        conditions = status.set_condition(
            conditions, "Degraded", "True", "InvalidSpec", message, _iso(now), generation
        )
        conditions = status.set_condition(
            conditions, "Ready", "False", "InvalidSpec", message, _iso(now), generation
        )
        new = {"phase": "Failed", "observedGeneration": generation, "conditions": conditions}
        self._event("Warning", "InvalidSpec", message)
        await self._write_status(old_status, new)

    async def _write_status(self, old: Mapping[str, Any], new: Mapping[str, Any]) -> None:
        patch = status.status_patch(old, new)
        if patch is not None:
            await k8s.patch_status(self.namespace, self.name, patch)


def _merge_keys(keys: Sequence[str], more: Sequence[str]) -> list[str]:
    out = list(keys)
    for k in more:
        if k not in out:
            out.append(k)
    return out[-HANDLED_LIMIT:]
