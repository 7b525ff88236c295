"""bench/strategies_group.py: a two-pod vLLM group over the StatefulSets the operator renders.

Checked against the operator's own reading of the objects (`step.needs`'s scrape targets, the
report parser's group checks) and the world's run of the group, so a loop that scraped one pod,
or reported ranks the pod does not hold, would fail here.
"""

from __future__ import annotations

import logging
import sys

from rankguard_operator.core.step import needs
from rankguard_sim.fake_vllm.args import parse_args
from tests import REPO

sys.path.insert(0, str(REPO / "bench"))

import strategies_group as sg
import strategies_measured as sm

CASE = next(c for c in sm.CASES if c.name == "clean-tp8-pp2")


def test_the_group_s_two_pods_are_scraped_and_report_their_own_ranks() -> None:
    logging.getLogger("rankguard_agent").setLevel(logging.ERROR)
    loop = sg.GroupLoop(CASE, sm.measured_spec(CASE))
    play = sm.World(CASE, loop)
    argv = loop.start_pod(1)
    args = parse_args(argv)
    assert (args.nnodes, args.node_rank) == (2, 0) and not loop.rolled
    run = play(argv)
    assert run.ready and not run.crashed
    loop.pod_ready()
    pods, sets = loop.observed()
    assert len(pods) == len(sets) == sg.PODS_PER_GROUP
    targets = [
        t[0]
        for t in needs(
            loop.spec_doc, loop.scenario.name, deployment=None, pods=pods, statefulsets=sets
        ).targets
    ]
    assert targets == [p["metadata"]["name"] for p in pods]
    for node, name in enumerate(targets):
        report = loop.report(run.idle_free, run.startup_min_free, run.startup_free, probe=True, pod=name)
        assert report.node_rank == node and report.nnodes == sg.PODS_PER_GROUP
        assert [s.rank for s in report.ranks] == list(range(8 * node, 8 * node + 8))
        assert all(s.warmup is not None and s.others_bytes == 0 for s in report.ranks)
    d = loop.operator_pass(run.idle_free, run.startup_min_free, run.startup_free)
    assert not d.changes_flags and not loop.rolled
    sizing = loop.objects.status["sizing"]
    assert sizing["mode"] == "engine-measured" and len(sizing["ranks"]) == loop.scenario.world_size
