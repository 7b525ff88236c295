"""`trust.trust`: which pods a pass listens to, and what it remembers between passes (a pod ahead
of its owner in the watch is not news yet; an ignored pod is said once while it exists)."""

from __future__ import annotations

from rankguard_operator.core.step import Memory, trust
from rankguard_operator.core.step.trust import UNVOUCHED_GRACE
from tests.builders import owned, owner_ref

SERVICE_UID = "svc-uid"


def _pass(pods: list[dict[str, object]], memory: Memory, now: float) -> tuple[list[str], list[str], Memory]:
    """(trusted pod names, reasons said this pass, the memory to hand on)."""
    got = trust(pods, {}, None, SERVICE_UID, statefulsets=[], memory=memory, now=now)
    names = [str(p["metadata"]["name"]) for p in got.pods]  # type: ignore[index]
    return names, [d.reason for d in got.newly_ignored], got.memory


def test_an_orphan_is_said_once_while_it_exists() -> None:
    orphan = owned("orphan", "u-1")
    trusted, said, memory = _pass([orphan], Memory(), now=0.0)
    assert trusted == [] and said == ["no-owner"]
    _, said, memory = _pass([orphan], memory, now=1.0)
    assert said == []  # said already
    _, said, memory = _pass([], memory, now=2.0)
    assert memory.said == frozenset()  # gone: forgotten
    _, said, _ = _pass([orphan], memory, now=3.0)
    assert said == ["no-owner"]  # back again: said again


def test_a_pod_ahead_of_its_owner_in_the_watch_is_news_only_after_the_grace() -> None:
    early = owned("svc-abcde", "u-2", owner_ref("ReplicaSet", "rs-unseen"))
    _, said, memory = _pass([early], Memory(), now=100.0)
    assert said == [] and "u-2" in memory.unvouched
    _, said, memory = _pass([early], memory, now=100.0 + UNVOUCHED_GRACE - 1)
    assert said == []
    _, said, memory = _pass([early], memory, now=100.0 + UNVOUCHED_GRACE)
    assert said == ["no-deployment"] and "u-2" not in memory.unvouched and "u-2" in memory.said
