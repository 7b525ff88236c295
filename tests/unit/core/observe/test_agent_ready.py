"""AgentReady: the agents that do not report, why, and since when.

The scraper against a real HTTP server (an agent's fallback answering 503 with its
`agentError`, a refused connection, a 404, a valid report), then the condition through
`reconcile.step`: True while every ready pod of the current template reports, False
(AgentUnavailable) once a pod has gone without a report for longer than the bound, quoting
the fallback's reason, one Event per change, and no flapping on one missed scrape."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web

from rankguard_operator.core.conditions import condition
from rankguard_operator.core.effects import PostEvent
from rankguard_operator.core.names import FLAGS_ANNOTATION, TEMPLATE_HASH_ANNOTATION
from rankguard_operator.core.observe.agent_ready import AgentMiss, clean_agent_error
from rankguard_operator.core.step import Step, reconcile
from rankguard_operator.core.units import GiB, iso
from rankguard_operator.edge.config import ConfigError, OperatorConfig
from rankguard_operator.edge.scrape import (
    MAX_ERROR_BODY,
    Scraper,
    Target,
    agent_error_of,
    close_shared_session,
)
from rankguard_sim.kube.cluster import free_port
from tests.unit.reconcile_world import SETTINGS, Cluster, pod, report, running

BOUND = 60.0
SAYS = "ModuleNotFoundError: No module named 'aiohttp'"


# --------------------------------------------------------------------------------------------
# What the fallback says, as rankguard shows it


def test_the_agent_error_is_one_printable_line_of_at_most_300_characters() -> None:
    assert clean_agent_error("boom:\n  line two\tthree\x1b[31m") == "boom: line two three [31m"
    long = clean_agent_error("x" * 1000)
    assert long is not None and len(long) == 300 and long.endswith("…")
    for not_text in (None, 3, ["a"], {"a": 1}, "", " \n "):
        assert clean_agent_error(not_text) is None


def test_only_a_json_objects_agent_error_string_is_taken() -> None:
    assert agent_error_of(json.dumps({"agentError": SAYS, "ranks": [1]}).encode()) == SAYS
    for body in (b"", b"not json", b"[1]", b'{"agentError": 42}', b'{"error": "x"}', b"[" * 100_000):
        assert agent_error_of(body) is None, body[:20]


# --------------------------------------------------------------------------------------------
# The scraper: why a report is missing, and since when


class Agent:
    """A pod's agent port: answers /report with whatever the test sets."""

    def __init__(self) -> None:
        self.status, self.body = 200, b""

    async def handle(self, _: web.Request) -> web.Response:
        return web.Response(status=self.status, body=self.body, content_type="application/json")


@pytest.fixture
async def agent() -> AsyncIterator[tuple[Agent, Target]]:
    a = Agent()
    app = web.Application()
    app.router.add_get("/report", a.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield a, Target("svc-abc", "127.0.0.1", port)
    finally:
        await runner.cleanup()


async def test_the_fallbacks_503_is_a_miss_that_quotes_its_reason_and_keeps_its_start(
    agent: tuple[Agent, Target],
) -> None:
    a, target = agent
    scraper = Scraper("svc", "ns")
    try:
        a.status, a.body = 503, json.dumps({"agentError": SAYS + "\nTraceback ...", "x": "y" * 100}).encode()
        first = await scraper.scrape([target])
        assert first.reports == []
        (miss,) = first.misses
        assert (miss.pod, miss.kind, miss.detail) == ("svc-abc", "agent-error", "HTTP 503")
        assert miss.agent_error == SAYS + " Traceback ..."
        again = await scraper.scrape([target])
        assert again.misses[0].since == miss.since  # one run of failures, one start

        a.status, a.body = 503, json.dumps({"agentError": "y" * MAX_ERROR_BODY}).encode()  # body cut
        (cut,) = (await scraper.scrape([target])).misses
        assert (cut.kind, cut.detail, cut.agent_error) == ("http-status", "HTTP 503", None)

        a.status, a.body = 404, b"{}"
        (other,) = (await scraper.scrape([target])).misses
        assert (other.kind, other.detail) == ("http-status", "HTTP 404")

        a.status, a.body = 200, b'{"version": 1'
        (bad,) = (await scraper.scrape([target])).misses
        assert (bad.kind, bad.detail) == ("malformed", "its report is malformed")

        a.status, a.body = 200, report((GiB, GiB), time.time()).to_json()
        ok = await scraper.scrape([target])
        assert [s.pod for s in ok.reports] == ["svc-abc"] and ok.misses == []
        a.status, a.body = 503, json.dumps({"agentError": SAYS}).encode()
        (later,) = (await scraper.scrape([target])).misses
        assert later.since > miss.since  # a success ends the run: a new one starts now
    finally:
        await scraper.close()
        await close_shared_session()  # as the operator's cleanup does


async def test_a_closed_port_is_unreachable() -> None:
    scraper = Scraper("svc", "ns")
    try:
        (miss,) = (await scraper.scrape([Target("svc-x", "127.0.0.1", free_port())])).misses
        assert miss.kind == "unreachable" and miss.detail.startswith("unreachable: ")
    finally:
        await scraper.close()
        await close_shared_session()  # as the operator's cleanup does


# --------------------------------------------------------------------------------------------
# The condition, through the step


def ready_since(c: Cluster, at: float) -> None:
    """The kubelet's Ready condition of every pod turned True at `at`."""
    for p in c.pods:
        p["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastTransitionTime": iso(at)}]


def step(c: Cluster, *, fresh: tuple[str, ...] = (), misses: tuple[AgentMiss, ...] = ()) -> Step:
    reports = tuple((name, report((6 * GiB, 6 * GiB), c.clock), c.clock) for name in fresh)
    world = replace(c.world(reports), agent_misses=misses)
    settings = replace(SETTINGS, agent_unavailable_after=BOUND)
    s = reconcile.step(c.state(), world, settings)
    for effect in s.effects:
        c.carry_out(effect)
    c.clock += 2.0
    return s


def agent_ready(c: Cluster) -> dict[str, Any]:
    return dict(condition(c.status["conditions"], "AgentReady") or {})


def events(c: Cluster, reason: str) -> list[PostEvent]:
    return [e for e in c.events.values() if e.reason == reason]


def test_before_any_pod_is_ready_the_condition_is_unknown() -> None:
    c = Cluster()
    step(c)
    got = agent_ready(c)
    assert (got["status"], got["reason"]) == ("Unknown", "NoReadyPods")


def test_every_ready_pod_reporting_is_true() -> None:
    c = running()
    name = c.pods[0]["metadata"]["name"]
    s = step(c, fresh=(name,))
    got = agent_ready(c)
    assert (got["status"], got["reason"]) == ("True", "Reporting") and s.agents_unavailable == ()


def test_a_pod_without_an_agent_past_the_bound_is_named_with_the_fallbacks_reason_once() -> None:
    c = running()
    name = c.pods[0]["metadata"]["name"]
    became_ready = c.clock
    ready_since(c, became_ready)
    miss = AgentMiss(name, "agent-error", "HTTP 503", became_ready, SAYS)
    step(c, misses=(miss,))
    got = agent_ready(c)
    assert (got["status"], got["reason"]) == ("Unknown", "WaitingForReports")  # within the bound
    while c.clock - became_ready <= BOUND:
        s = step(c, misses=(miss,))
    for _ in range(3):
        s = step(c, misses=(miss,))
    got = agent_ready(c)
    assert (got["status"], got["reason"]) == ("False", "AgentUnavailable")
    for words in (name, f'"{SAYS}"', "vLLM keeps serving", "rankguard-agent:", "budget changes"):
        assert words in got["message"], got["message"]
    assert s.agents_unavailable == (name,)
    assert [e.type for e in events(c, "AgentUnavailable")] == ["Warning"]  # one Event, not per pass
    assert c.status["phase"] == "Running"  # vLLM serves: nothing is degraded by this alone

    step(c, fresh=(name,))  # the agent is back (a new image, a fixed bundle)
    step(c, fresh=(name,))
    got = agent_ready(c)
    assert (got["status"], got["reason"]) == ("True", "Reporting")
    assert len(events(c, "AgentsReporting")) == 1 and len(events(c, "AgentUnavailable")) == 1


def test_one_missed_scrape_of_a_long_ready_pod_does_not_flap() -> None:
    c = running()
    name = c.pods[0]["metadata"]["name"]
    ready_since(c, c.clock - 3600)
    step(c, fresh=(name,))
    before = agent_ready(c)
    # the scraper's run of failures starts now: a timeout after an hour of good reports
    step(c, misses=(AgentMiss(name, "unreachable", "unreachable: TimeoutError", c.clock),))
    assert agent_ready(c) == before
    assert events(c, "AgentUnavailable") == []


def test_pods_not_ready_or_of_an_old_template_do_not_count() -> None:
    c = running()
    live = c.pods[0]
    name = live["metadata"]["name"]
    old = pod("svc-old", {TEMPLATE_HASH_ANNOTATION: "0000", FLAGS_ANNOTATION: "{}"}, ready=True)
    starting = pod("svc-new", copy.deepcopy(live["metadata"]["annotations"]), ready=False)
    c.pods = [live, old, starting]
    ready_since(c, c.clock - 3600)
    starting["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    long_ago = c.clock - 3600
    misses = tuple(AgentMiss(p, "unreachable", "unreachable: x", long_ago) for p in ("svc-old", "svc-new"))
    step(c, fresh=(name,), misses=misses)
    got = agent_ready(c)
    assert (got["status"], got["reason"]) == ("True", "Reporting")
    assert "1 pod" in got["message"]


def test_the_bound_is_configured_once_and_a_bad_value_is_refused_by_name() -> None:
    assert OperatorConfig.from_env({}).settings.agent_unavailable_after == 60.0
    env = {"RANKGUARD_AGENT_UNAVAILABLE_AFTER": "5"}
    assert OperatorConfig.from_env(env).settings.agent_unavailable_after == 5.0
    with pytest.raises(ConfigError, match="RANKGUARD_AGENT_UNAVAILABLE_AFTER"):
        OperatorConfig.from_env({"RANKGUARD_AGENT_UNAVAILABLE_AFTER": "0"})
