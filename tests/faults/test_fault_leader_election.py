"""Drill 5: two operator replicas with leader election, one CUDA OOM, exactly one roll.

Both operators watch the drill's namespace with RANKGUARD_LEADER_ELECTION on, on one Lease.
The service starts at vLLM's default utilisation, which runs rank 0 out of GPU memory under
load (the CUDA OOM story of examples/llama3-70b-tp4.yaml). Exactly one replica leads, the
other waits as a standby (its /healthz answers, it exports rankguard_operator_leader 0 and
never a pass). The OOM is remediated once: one history entry, one roll, one Event, counted
by one operator. Then the leader is SIGKILLed (no release): the standby takes the Lease once
it has not been renewed for a whole lease, and carries on without rolling again.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families

from rankguard_operator.core.observe.pods import CUDA_OOM
from rankguard_sim.world import OperatorProcess

from .conftest import Drill, is_ready, revision, service_doc, wait_for, wait_observed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

SERVICE = "led"
LEASE = "rankguard-drill"


def metric(op: OperatorProcess, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(op.metrics_text()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def holder(d: Drill) -> str:
    """Who holds the Lease; "" while nobody does, or before the first replica created it (a
    replica answers /healthz before its elector's first try, which a busy machine can delay)."""
    try:
        lease = client.CoordinationV1Api(d.api).read_namespaced_lease(LEASE, d.namespace)
    except ApiException as e:
        if e.status == 404:
            return ""
        raise
    return str(lease.spec.holder_identity or "")


def test_two_replicas_one_oom_one_roll_and_the_standby_takes_over(drill: Drill) -> None:
    d = drill
    d.start_node(services=1)
    ops = {
        who: OperatorProcess(
            d.cp.kubeconfig,
            d.workdir / f"operator-{who}.log",
            env_extra={
                "RANKGUARD_WATCH_NAMESPACES": d.namespace,
                "RANKGUARD_RESYNC_INTERVAL": "2",  # the new leader's passes are counted (conftest)
                "RANKGUARD_LEADER_ELECTION": "true",
                "RANKGUARD_LEASE_NAME": LEASE,
                "RANKGUARD_LEASE_NAMESPACE": d.namespace,
                "RANKGUARD_POD_NAME": who,
            },
            metrics=True,
        )
        for who in ("op-a", "op-b")
    }
    try:
        for op in ops.values():
            op.start()
        for op in ops.values():
            op.wait_ready()  # the standby answers /healthz too
        leader = wait_for("a leader", lambda: holder(d) or None, 60)
        standby = next(w for w in ops if w != leader)
        d.operator = ops[leader]  # the drill's dump shows the leader's log
        d.create_service(service_doc(SERVICE))

        def remediated() -> dict[str, Any] | None:
            svc = d.service(SERVICE)
            done = [
                r for r in (svc.get("status") or {}).get("remediations") or [] if r["trigger"] == CUDA_OOM
            ]
            return svc if done and is_ready(svc) else None

        svc = wait_for("the CUDA OOM remediated and Ready again", remediated, 240, every=0.5, dump=d.dump)
        history = [r for r in svc["status"]["remediations"] if r["trigger"] == CUDA_OOM]
        assert len(history) == 1, history
        assert revision(wait_observed(d, SERVICE)) == 2  # created, then rolled once
        rolls = {w: metric(op, "rankguard_operator_remediations_total") for w, op in ops.items()}
        assert rolls == {leader: 1.0, standby: 0.0}, rolls
        assert metric(ops[leader], "rankguard_operator_leader") == 1.0
        assert metric(ops[standby], "rankguard_operator_leader") == 0.0
        assert metric(ops[standby], "rankguard_operator_passes_total") == 0.0  # it never acted
        assert metric(ops[leader], "rankguard_operator_ooms_observed_total", reason=CUDA_OOM, rank="0") >= 1
        led = ops[leader].log.read_text()
        assert re.search(
            rf"LLMService {d.namespace}/{SERVICE}: phase \w+ -> Running", led
        )  # a line per change
        assert "/healthz" not in led  # the probes (wait_ready's among them) are not logged
        assert "standby: the Lease" in ops[standby].log.read_text()
        events = [e for e in d.events(SERVICE) if e.reason == "ShrinkKVCache"]
        assert len(events) == 1 and (events[0].count or 1) == 1, events

        # The leader dies without giving the Lease up: the standby waits out the lease, then leads.
        ops[leader].kill()
        wait_for("the standby to lead", lambda: holder(d) == standby, 90, dump=d.dump)
        wait_for(
            "the new leader's passes",
            lambda: metric(ops[standby], "rankguard_operator_passes_total", llmservice=SERVICE) >= 3,
            60,
            dump=d.dump,
        )
        assert metric(ops[standby], "rankguard_operator_leader") == 1.0
        svc = d.service(SERVICE)
        assert len([r for r in svc["status"]["remediations"] if r["trigger"] == CUDA_OOM]) == 1
        assert revision(wait_observed(d, SERVICE)) == 2  # no second roll
        assert metric(ops[standby], "rankguard_operator_remediations_total") == 0.0
        assert "lost leadership" not in ops[standby].log.read_text()
    finally:
        for op in ops.values():
            op.stop()
