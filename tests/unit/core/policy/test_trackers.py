"""The steady state and the trackers the caller keeps between decisions.

When no rule applies the decision still explains itself; the trackers (low and ample headroom
since when, last-known-good flags) are pure, previous value in and next value out, and decide
when rules 7 and 9 fire and what a rollback returns to.
"""

from __future__ import annotations

from typing import Any

from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.policy import (
    decide,
    headroom_due_in,
    headroom_lines,
    next_last_known_good,
    track_ample_headroom,
    track_ample_lowest,
    track_low_headroom,
)
from rankguard_operator.core.policy.tunables import LOW_HEADROOM_SUSTAIN_SECONDS, RECLAIM_AFTER_SECONDS
from rankguard_operator.core.units import GiB
from tests.unit.core.policy_world import (
    AMPLE,
    COMPLETE,
    CUR,
    HEALTHY,
    LKG,
    LOW,
    MINH,
    NOW,
    PROGRESSING,
    SPEC,
    inp,
    obs,
    term,
)


def test_steady() -> None:
    d = decide(inp())
    assert (d.action, d.reason, d.rank, d.flags, d.handled) == ("none", "Stable", 0, CUR, ())
    assert not d.changes_flags and "bottleneck rank 0 has 2Gi headroom" in d.message
    assert decide(inp(observation=None)).reason == "NoFreshData"


def test_track_low_headroom() -> None:
    assert track_low_headroom(None, LOW, SPEC, NOW) == NOW
    assert track_low_headroom(NOW - 30, LOW, SPEC, NOW) == NOW - 30
    assert track_low_headroom(NOW - 30, HEALTHY, SPEC, NOW) is None
    assert track_low_headroom(NOW - 30, obs(MINH), SPEC, NOW) is None  # at the minimum is fine
    assert track_low_headroom(NOW - 30, obs(GiB, stale=True), SPEC, NOW) == NOW - 30
    assert track_low_headroom(None, None, SPEC, NOW) is None


def test_track_ample_headroom() -> None:
    assert track_ample_headroom(None, AMPLE, SPEC, NOW) == NOW
    assert track_ample_headroom(NOW - 5, AMPLE, SPEC, NOW) == NOW - 5
    assert track_ample_headroom(NOW - 5, obs(2 * MINH), SPEC, NOW) == NOW - 5  # boundary: 2 × minimum
    assert track_ample_headroom(NOW - 5, obs(2 * MINH - 1), SPEC, NOW) is None
    assert track_ample_headroom(NOW - 5, None, SPEC, NOW) == NOW - 5


def test_track_ample_lowest_keeps_the_stretchs_least_free_memory() -> None:
    since = NOW - 600
    assert track_ample_lowest(None, None, None, AMPLE) is None  # no stretch
    assert track_ample_lowest(None, None, since, AMPLE) == 5 * GiB  # a stretch starts: the bottleneck's
    assert track_ample_lowest(4 * GiB, since, since, AMPLE) == 4 * GiB  # a lower figure earlier stays
    assert track_ample_lowest(6 * GiB, since, since, AMPLE) == 5 * GiB
    assert track_ample_lowest(4 * GiB, since - 60, since, AMPLE) == 5 * GiB  # a new stretch starts over
    assert track_ample_lowest(4 * GiB, since, since, None) == 4 * GiB  # no data: kept
    assert track_ample_lowest(4 * GiB, since, since, obs(GiB, stale=True)) == 4 * GiB  # stale: kept
    assert track_ample_lowest(4 * GiB, since, None, AMPLE) is None  # the stretch ended


def test_last_known_good() -> None:
    def lkg(**kw: Any) -> ServingFlags | None:
        args: dict[str, Any] = {"spec": SPEC, "rollout": COMPLETE, "observation": HEALTHY}
        args.update(kw)
        return next_last_known_good(LKG, CUR, **args)

    assert lkg() == CUR
    assert lkg(rollout=PROGRESSING) == LKG
    assert lkg(rollout=None) == LKG
    assert lkg(observation=LOW) == LKG
    assert lkg(observation=obs(GiB, stale=True)) == LKG
    assert lkg(terminations=[term()]) == LKG
    assert lkg(terminations=[term(flags=LKG)]) == CUR  # an old pod's crash says nothing about CUR
    assert lkg(terminations=[term("Other")]) == CUR
    assert next_last_known_good(LKG, None, spec=SPEC, rollout=COMPLETE, observation=HEALTHY) == LKG


def test_a_headroom_stretch_under_way_names_when_its_rule_falls_due() -> None:
    # passes are rare for a steady service (issue 31): the step asks for one when a stretch is due
    assert headroom_due_in(None, None, NOW) is None
    assert headroom_due_in(NOW - 10, None, NOW) == LOW_HEADROOM_SUSTAIN_SECONDS - 10
    assert headroom_due_in(None, NOW - 100, NOW) == RECLAIM_AFTER_SECONDS - 100
    assert headroom_due_in(NOW - 10, NOW - 100, NOW) == LOW_HEADROOM_SUSTAIN_SECONDS - 10
    # one already due had its pass: no pass at once again (that would be a busy loop)
    assert headroom_due_in(NOW - LOW_HEADROOM_SUSTAIN_SECONDS, None, NOW) is None


def test_the_lines_are_where_the_headroom_trackers_turn() -> None:
    low, ample = headroom_lines(SPEC)
    assert track_low_headroom(None, obs(low - 1), SPEC, NOW) == NOW
    assert track_low_headroom(None, obs(low), SPEC, NOW) is None
    assert track_ample_headroom(None, obs(ample), SPEC, NOW) == NOW
    assert track_ample_headroom(None, obs(ample - 1), SPEC, NOW) is None
