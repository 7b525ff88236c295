"""The guard rails on every flag change: remediation switched off, cooldown, changes per hour.

They keep the operator from flapping a service's flags; a held change says when to retry, and a
crash under the flags the last change produced is fixed at once rather than waited out.
"""

from __future__ import annotations

import pytest

from rankguard_operator.core.policy import decide
from rankguard_operator.core.units import GiB
from tests.unit.core.policy_world import CUR, KV, inp, past, spec_with, term


def test_cooldown_holds_and_says_when_to_retry() -> None:
    t = term()
    # The last change led somewhere else (the current flags came from a person's edit).
    d = decide(inp(new_terminations=[t], history=[past(100, to=KV + GiB)]))
    assert (d.action, d.trigger, d.reason, d.held_action) == ("hold", "Cooldown", "CooldownActive", "shrink")
    assert d.retry_after == pytest.approx(200) and d.handled == () and d.flags == CUR
    assert "within the 300s cooldown" in d.message and "held: rank 2 ran out" in d.message
    assert decide(inp(new_terminations=[t], history=[past(300, to=KV + GiB)])).action == "shrink"  # boundary


def test_a_crash_under_the_last_changes_flags_is_fixed_within_the_cooldown() -> None:
    # The last change produced the current flags and they crash: waiting out the cooldown
    # would only keep the service down.
    d = decide(inp(new_terminations=[term()], history=[past(100, to=KV)]))
    assert d.action == "shrink" and d.trigger == "CUDAOutOfMemory"
    # A pre-emptive change is still held.
    four = [past(3599), past(3000), past(2000), past(100, to=KV)]
    assert decide(inp(new_terminations=[term()], history=four)).reason == "RateLimited"


def test_rate_limit_counts_the_last_hour() -> None:
    four = [past(3599), past(3000), past(2000), past(1000)]
    d = decide(inp(new_terminations=[term()], history=four))
    assert (d.action, d.trigger, d.reason) == ("hold", "RateLimit", "RateLimited")
    assert d.retry_after == pytest.approx(1)
    three = [past(3600), past(3000), past(2000), past(1000)]  # the oldest is out of the window
    assert decide(inp(new_terminations=[term()], history=three)).action == "shrink"
    none_allowed = spec_with(remediation={"maxPerHour": 0})
    assert decide(inp(spec=none_allowed, new_terminations=[term()])).trigger == "RateLimit"


def test_disabled_remediation_only_reports() -> None:
    s = spec_with(remediation={"enabled": False})
    d = decide(inp(spec=s, new_terminations=[term()]))
    assert (d.action, d.reason, d.retry_after, d.flags) == ("hold", "RemediationDisabled", None, CUR)
    assert "spec.remediation.enabled: false" in d.message
    assert decide(inp(spec=s, current=None)).action == "initial"  # still deploys
