"""Drill 1: SIGKILL the operator again and again while a dozen services remediate a CUDA OOM;
every one of them must end with exactly one roll, one history entry and one Event.

Twelve copies of the rank-0 OOM story (examples/llama3-70b-tp4.yaml at vLLM's default
utilisation) start a couple of seconds apart on one simulated node, so their OOMs, and the
operator's answers to them, are spread over a minute or so. Meanwhile the operator is
killed with SIGKILL (no shutdown handler runs) at moments chosen by a seeded random plan,
and started again. A kill is either timed (it lands wherever the services happen to be) or
follows a step the drill watches for (a new `status.pendingRemediation`, a new
`rankguard.io/remediation-id` on a Deployment), so it lands between the steps of a pass:
after the intent and before the roll, or after the roll and before the final status write.
Kills follow steps until three have interrupted a remediation; the plan draws freely after.
Right after each kill the drill records where every service stood (the operator is dead,
so nothing of its moves). Rerun a plan with RANKGUARD_FAULT_SEED=<the seed printed>.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client, watch

from rankguard_operator.core.names import LLMSERVICE_LABEL, REMEDIATION_ID_ANNOTATION
from rankguard_operator.core.observe.pods import CUDA_OOM, terminations
from rankguard_sim.waiting import let_time_pass

from .conftest import (
    GROUP,
    PLURAL,
    VERSION,
    Drill,
    is_ready,
    remediation_id,
    revision,
    service_doc,
    wait_for,
    wait_settled,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SERVICES = 12
MAX_KILLS = 10
# Where a service can be when the operator dies, in the order of its remediation.
BEFORE_OOM = "before-oom"
OOM_UNHANDLED = "oom-no-intent"  # a CUDA OOM in a pod's status, no intent written yet
INTENT = "intent-not-rolled"  # status.pendingRemediation written, the Deployment not rolled
ROLLED = "rolled-status-pending"  # the Deployment carries the id, the intent not cleared yet
DONE = "done"
MID_REMEDIATION = (OOM_UNHANDLED, INTENT, ROLLED)


def phase(svc: dict[str, Any], deployment: dict[str, Any] | None, pods: list[dict[str, Any]]) -> str:
    st = svc.get("status") or {}
    pending = st.get("pendingRemediation") or {}
    if pending.get("id"):
        return ROLLED if remediation_id(deployment) == pending["id"] else INTENT
    if any(r.get("trigger") == CUDA_OOM for r in st.get("remediations") or []):
        return DONE
    handled = set(st.get("handledTerminations") or [])
    name = svc["metadata"]["name"]
    mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(LLMSERVICE_LABEL) == name]
    if any(t.kind == CUDA_OOM and t.key not in handled for p in mine for t in terminations(p)):
        return OOM_UNHANDLED
    return BEFORE_OOM


@dataclass
class Kill:
    number: int
    trigger: str
    at: float  # seconds since the first service was created
    phases: dict[str, str]


class StepWatch:
    """Watches the drill's LLMServices and Deployments in background threads and sets `intent`
    on every new `status.pendingRemediation` id and `roll` on every new remediation id on a
    Deployment, so a kill can follow the step it is meant to interrupt within milliseconds."""

    def __init__(self, d: Drill) -> None:
        self.d = d
        self.intent, self.roll = threading.Event(), threading.Event()
        self._stop = threading.Event()
        self._seen: set[str] = set()
        self._threads = [
            threading.Thread(target=self._run, args=(self._services, self._on_service), daemon=True),
            threading.Thread(target=self._run, args=(self._deployments, self._on_deployment), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _services(self, api: client.ApiClient) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        ns = self.d.namespace
        return client.CustomObjectsApi(api).list_namespaced_custom_object, (GROUP, VERSION, ns, PLURAL)

    def _deployments(self, api: client.ApiClient) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return client.AppsV1Api(api).list_namespaced_deployment, (self.d.namespace,)

    def _on_service(self, obj: Any) -> None:
        pending = ((obj.get("status") or {}).get("pendingRemediation") or {}).get("id")
        if pending and f"intent/{pending}" not in self._seen:
            self._seen.add(f"intent/{pending}")
            self.intent.set()

    def _on_deployment(self, obj: Any) -> None:
        rid = (obj.metadata.annotations or {}).get(REMEDIATION_ID_ANNOTATION)
        if rid and f"roll/{rid}" not in self._seen:
            self._seen.add(f"roll/{rid}")
            self.roll.set()

    def _run(self, lister: Callable[..., Any], handle: Callable[[Any], None]) -> None:
        api = self.d.cp.api_client()
        # the client's own method (not a wrapper): the watch reads its return type from it
        method, args = lister(api)
        try:
            while not self._stop.is_set():
                w = watch.Watch()
                try:
                    for event in w.stream(method, *args, timeout_seconds=20):
                        handle(event["object"])
                        if self._stop.is_set():
                            break
                except Exception:  # a dropped watch: start another, as any client would
                    self._stop.wait(0.2)
        finally:
            api.close()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)


def test_sigkill_during_remediation_rolls_each_service_exactly_once(drill: Drill) -> None:
    d = drill
    seed = int(os.environ.get("RANKGUARD_FAULT_SEED", str(random.SystemRandom().randrange(1 << 31))))
    print(f"\nkill drill: seed {seed} (RANKGUARD_FAULT_SEED={seed} replays this kill plan)")
    rng = random.Random(seed)
    d.start_node(services=SERVICES)
    d.start_operator(metrics=True)
    names = [f"svc-{i:02d}" for i in range(SERVICES)]
    started = time.monotonic()
    steps = StepWatch(d)

    created_errors: list[BaseException] = []
    finished = threading.Event()  # the test is over, whichever way: create no more
    gaps = [rng.uniform(1.0, 3.0) for _ in names]

    def create_spread_out() -> None:
        try:
            for name, gap in zip(names, gaps, strict=True):
                d.create_service(service_doc(name))
                # Letting time pass is the point: the services' OOMs (and the operator's answers)
                # come at different moments, so one kill finds them in different steps.
                if let_time_pass(gap, stop=finished.is_set):
                    return
        except BaseException as e:  # raised again in the test's thread below
            created_errors.append(e)

    creator = threading.Thread(target=create_spread_out, daemon=True)
    creator.start()

    def all_done() -> bool:
        services = d.services()
        return len(services) == SERVICES and all(
            any(r.get("trigger") == CUDA_OOM for r in (s.get("status") or {}).get("remediations") or [])
            and not (s.get("status") or {}).get("pendingRemediation")
            for s in services.values()
        )

    kills: list[Kill] = []
    try:
        for number in range(1, MAX_KILLS + 1):
            if all_done():
                break
            # Kills follow steps until three have interrupted a remediation, so no draw leaves the
            # drill without them (a remediation takes well under a second: a timed kill finds one
            # only by luck); after that a kill may land anywhere.
            interrupted = sum(any(p in MID_REMEDIATION for p in k.phases.values()) for k in kills)
            trigger = rng.choice(("intent", "roll") if interrupted < 3 else ("timer", "intent", "roll"))
            if trigger == "timer":
                # Letting time pass is the point: this kill lands wherever the services are,
                # unless they are all done meanwhile (then there is nothing left to interrupt).
                if let_time_pass(rng.uniform(0.5, 4.0), stop=all_done, every=0.5):
                    break
            else:
                event = steps.intent if trigger == "intent" else steps.roll
                if not event.wait(45):
                    continue  # no service took that step any more: nothing to interrupt
            d.op.kill()
            at = time.monotonic() - started
            services, deployments, pods = d.services(), d.deployments(), d.pods()
            kills.append(
                Kill(
                    number,
                    trigger,
                    at,
                    {n: phase(s, deployments.get(n), pods) for n, s in sorted(services.items())},
                )
            )
            # The operator stays dead a moment, as a rescheduled pod would: pods may run out of
            # memory meanwhile and be found by the next operator with no intent written.
            let_time_pass(rng.uniform(0.0, 3.0))
            steps.intent.clear()
            steps.roll.clear()
            d.op.start()
            d.op.wait_ready()
        creator.join(timeout=120)
        assert not created_errors, created_errors

        def all_ready_once() -> bool:
            return all_done() and all(is_ready(s) for s in d.services().values())

        wait_for("every service remediated once and Ready again", all_ready_once, 300, every=1, dump=d.dump)
    finally:
        finished.set()
        steps.close()

    deps = wait_settled(d, names)
    # A duplicate roll would come from a pass that decides again what was already done: give the
    # operator three more passes of every service to make one, then read everything again.
    floor = {n: d.passes(n) for n in names}
    wait_for(
        "three more operator passes of every service",
        lambda: all(d.passes(n) >= floor[n] + 3 for n in names),
        120,
        dump=d.dump,
    )
    deps = wait_settled(d, names)
    services = d.services()

    print(f"\n{len(kills)} kills (trigger, seconds after the first service, where each service stood):")
    for k in kills:
        counts = Counter(k.phases.values())
        mid = {n: p for n, p in k.phases.items() if p in MID_REMEDIATION}
        print(f"  kill {k.number:2d} {k.trigger:6s} at {k.at:5.1f}s  {dict(counts)}  mid-remediation: {mid}")
    print(
        "\ntrial  service  rolls  history  events  replicasets  event reason         "
        "kills that found it mid-remediation"
    )
    failures: list[str] = []
    for i, name in enumerate(names, 1):
        st = services[name].get("status") or {}
        history = st.get("remediations") or []
        dep = deps[name]
        rolls = revision(dep) - 1
        rid = remediation_id(dep)
        # Remediation Events are named <service>.<remediation id> (12 hex characters), so a
        # second post after a restart is refused (409); any other id is a second remediation.
        events = [
            e
            for e in d.events(name)
            if (e.metadata.name or "").startswith(f"{name}.")
            and len(e.metadata.name) == len(name) + 13
            and all(c in "0123456789abcdef" for c in e.metadata.name[len(name) + 1 :])
        ]
        landed = [f"#{k.number}:{k.phases[name]}" for k in kills if k.phases.get(name) in MID_REMEDIATION]
        replicasets = len(d.replicasets_of(dep))
        print(
            f"  {i:3d}  {name}  {rolls:5d}  {len(history):7d}  {len(events):6d}  {replicasets:11d}  "
            f"{','.join(e.reason for e in events) or '-':20s} {' '.join(landed) or '-'}"
        )
        ids = {h.get("revision") for h in history}
        if not (rolls == 1 and len(history) == 1 and len(events) == 1 and replicasets == 2):
            failures.append(
                f"{name}: {rolls} rolls, {len(history)} history entries, {len(events)} Events, "
                f"{replicasets} ReplicaSets (want 1, 1, 1, 2); history {history}"
            )
        elif not (ids == {rid} and events[0].metadata.name == f"{name}.{rid}"):
            failures.append(
                f"{name}: the roll ({rid}), the history ({ids}) and the Event "
                f"({events[0].metadata.name}) name different remediations"
            )
        if history and history[0].get("trigger") != CUDA_OOM:
            failures.append(f"{name}: the remediation was {history[0].get('trigger')}, not the CUDA OOM")
        if st.get("pendingRemediation"):
            failures.append(f"{name}: an intent is still pending: {st['pendingRemediation']}")
    by_step = Counter(p for k in kills for p in k.phases.values() if p in MID_REMEDIATION)
    interrupting = [k for k in kills if any(p in MID_REMEDIATION for p in k.phases.values())]
    print(
        f"\n{len(interrupting)} of {len(kills)} kills found services mid-remediation; "
        f"service-kills by step: {dict(by_step)} (seed {seed})"
    )
    assert not failures, "\n".join(failures)
    # The drill proves something only if kills interrupted remediations.
    assert len(interrupting) >= 3, f"only {len(interrupting)} kills interrupted a remediation (seed {seed})"
