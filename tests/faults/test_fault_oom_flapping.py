"""Drill 4: an engine that runs out of GPU memory at every start, whatever its budget.

No built-in scenario does that (each has a budget that holds), so the drill uses the process
kubelet's fault injection: every start of a `vllm` container on the drill's node fails in its
first second with PyTorch's CUDA OOM ("Tried to allocate 2.00 GiB ... 1.00 GiB is free"), as a
GPU shared with a process the budget cannot see would. rankguard shrinks the budget after each
OOM (a crash under the flags of its own last change skips the cooldown), so without guard rails
it would roll the Deployment at every crash. The guard rails must hold: at most
`spec.remediation.maxPerHour` rolls within the hour (core/policy/guard.py), then the service
Degraded with a reason (RateLimited; OOMAtFloor had the floor come first), and no further roll
while the engine keeps crashing.
"""

from __future__ import annotations

from typing import Any

import pytest

from rankguard_operator.core.names import VLLM_CONTAINER

from .conftest import Drill, condition, revision, service_doc, wait_for, wait_observed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

SERVICE = "flappy"
MAX_PER_HOUR = 3
GUARD_REASONS = ("RateLimited", "OOMAtFloor")
CRASHES_OBSERVED = 3  # crashes the operator must see, and hold, once Degraded
OOM_AT_START = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.14 GiB of "
    "which 1.00 GiB is free. Including non-PyTorch memory, this process has 76.13 GiB memory in use."
)


def crashes(pods: list[dict[str, Any]]) -> int:
    """Ended runs of the vLLM container over the service's pods that still exist."""
    total = 0
    for p in pods:
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") == VLLM_CONTAINER:
                total += int(cs.get("restartCount") or 0)
                total += 1 if (cs.get("state") or {}).get("terminated") else 0
    return total


def test_flapping_ooms_stay_within_the_guard_rails_and_degrade(drill: Drill) -> None:
    d = drill
    node = d.start_node(services=1)
    node.inject_start_faults(VLLM_CONTAINER, 500, OOM_AT_START)
    d.start_operator(metrics=True)
    d.create_service(service_doc(SERVICE, start_at_default=False, maxPerHour=MAX_PER_HOUR))

    def held() -> dict[str, Any] | None:
        svc = d.service(SERVICE)
        deg = condition(svc, "Degraded")
        return svc if deg and deg["status"] == "True" and deg.get("reason") in GUARD_REASONS else None

    svc = wait_for("Degraded by a guard rail", held, 300, every=0.5, dump=d.dump)
    dep = wait_observed(d, SERVICE)
    rolls = revision(dep) - 1
    # The engine keeps crashing: the operator sees every crash and must hold each time.
    seen = crashes(d.pods())
    passes = d.passes(SERVICE)
    wait_for(
        f"{CRASHES_OBSERVED} more crashes and operator passes while Degraded",
        lambda: crashes(d.pods()) >= seen + CRASHES_OBSERVED and d.passes(SERVICE) >= passes + 3,
        180,
        dump=d.dump,
    )
    after = d.service(SERVICE)
    dep_after = wait_observed(d, SERVICE)
    history = (after.get("status") or {}).get("remediations") or []
    deg = condition(after, "Degraded") or {}
    print(
        f"\nflapping OOMs: {rolls} rolls before the guard rail, {revision(dep_after) - 1} after "
        f"{crashes(d.pods()) - seen} more crashes; {len(history)} history entries; Degraded "
        f"{deg.get('status')} {deg.get('reason')}: {str(deg.get('message'))[:200]}"
    )
    assert 1 <= rolls <= MAX_PER_HOUR, f"{rolls} rolls; spec.remediation.maxPerHour is {MAX_PER_HOUR}"
    assert revision(dep_after) - 1 == rolls, "the Deployment was rolled again after the guard rail held"
    assert len(history) == rolls and all(h.get("trigger") == "CUDAOutOfMemory" for h in history), history
    assert deg.get("status") == "True" and deg.get("reason") in GUARD_REASONS, deg
    assert svc["status"].get("servingFlags") == after["status"].get("servingFlags")
