"""`gather.needs`: what a pass reads, from the spec parsed once for the whole pass."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.step import needs, reconcile
from rankguard_operator.core.units import GiB
from tests.unit.reconcile_world import SETTINGS, report, running


@contextmanager
def calls_of(fn: Callable[..., Any]) -> Iterator[list[int]]:
    """Count the calls of `fn` while the block runs (the interpreter's own profile hook: the code
    under test is run as it is, nothing patched)."""
    count = [0]
    code = fn.__code__

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            count[0] += 1

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield count
    finally:
        sys.setprofile(before)


def _one_pass(*, hand_on: bool) -> int:
    """A Running service's pass as the edge makes it: needs, then the step; the parses counted."""
    c = running()
    pods = c.pods
    with calls_of(parse_spec) as parses:
        wanted = needs(c.spec, "svc", deployment=c.deployment, pods=pods, now=c.clock)
        sample = report((10 * GiB, 10 * GiB), c.clock)
        reports = tuple((name, sample, c.clock) for name, _, _ in wanted.targets)
        world = c.world(reports=reports)
        step = reconcile.step(c.state(), world, SETTINGS, wanted.spec if hand_on else None)
    assert step.decision is not None and wanted.targets  # a whole pass, with its agents' reports
    return parses[0]


def test_one_pass_parses_the_spec_once() -> None:
    assert _one_pass(hand_on=True) == 1
    # the count can fail: a step not handed the parsed spec parses it again
    assert _one_pass(hand_on=False) == 2


def test_needs_names_every_read_of_a_pass() -> None:
    c = running()
    spec = {
        **c.spec,
        "model": {"name": "m", "configMap": {"name": "cfg"}},
        "memory": {},
        "modelCache": {"size": "100Gi"},
    }
    pods = [
        {**p, "spec": {**p.get("spec", {}), "nodeName": n}}
        for p, n in zip(c.pods * 2, ("n2", "n1"), strict=True)
    ]
    wanted = needs(spec, "svc", deployment=c.deployment, pods=pods)
    assert wanted.parsed is not None
    assert wanted.config_map == ("cfg", "config.json")
    assert wanted.claim is not None and wanted.claim.startswith("svc")
    assert wanted.nodes == ("n1", "n2")  # no GPU size in the spec: the nodes' labels may say it
    assert wanted.lines and all(line > 0 for line in wanted.lines)


def test_an_unreadable_spec_needs_nothing_read() -> None:
    c = running()
    wanted = needs({"model": {}}, "svc", deployment=c.deployment, pods=c.pods)
    assert isinstance(wanted.spec, SpecError) and wanted.parsed is None
    assert (wanted.config_map, wanted.claim, wanted.nodes, wanted.targets) == (None, None, (), ())
    # the step is handed the refusal and says why, without parsing again
    with calls_of(parse_spec) as parses:
        step = reconcile.step(c.state(), c.world(), SETTINGS, wanted.spec)
    assert parses[0] == 0 and step.decision is None and step.phase == "Failed"
