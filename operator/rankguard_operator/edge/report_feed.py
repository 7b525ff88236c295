"""One LLMService's agents, long-polled: each serving pod's latest report, and a wake-up for the
service's loop only when one is news (issue 31).

Scraping every pod every 2 s made a Running service pass, and rewrite its status, 30 times a
minute for nothing: free memory moves a little between any two samples. Here each serving pod
has one task holding `GET /report?wait=…&since=…&lines=…` open (the agent's long-poll,
rankguard_agent.wire.change): the agent answers when its report is news (a rank's figure moved by
1 % of its GPU or crossed a policy line, a KV or engine line, an error), or after `wait` seconds
with the report as it is, which keeps the report fresh for `core/observe/headroom`'s staleness
(`wait` is two thirds of `stale_after`). The answer is kept; the service's loop is woken only when
it is news against the report its last pass read, so a slow drift still adds up to a pass.

The pass reads the kept answers (`read`); a pod it sees for the first time is asked at once and
waited for (bounded by the scrape timeout), so a new pod's first pass is as it was. A failed poll
is an `AgentMiss`, kept and tried again after `retry` seconds; it wakes the loop when the kind of
failure changes. An agent that answers without a token (an older one, which ignores `wait`) is
asked again every `retry` seconds, as it was scraped before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from rankguard_agent.wire.change import news
from rankguard_agent.wire.report import Report
from rankguard_operator.core.observe.agent_ready import AgentMiss
from rankguard_operator.edge.scrape import TIMEOUT, Scrape, Scraped, Scraper, Target

log = logging.getLogger("rankguard_operator.edge.report_feed")

MAX_WAIT_SECONDS = 20.0  # a held poll's longest wait (less when stale_after is shorter)
ANSWER_GRACE_SECONDS = 5.0  # beyond `wait`: the agent's answer on the way, a busy loop


@dataclass
class _Poll:
    target: Target
    latest: Scraped | AgentMiss | None = None
    answered: asyncio.Event = field(default_factory=asyncio.Event)  # set at its first answer
    awaited: bool = False  # a pass is waiting for its first answer (which then wakes nobody)
    task: asyncio.Task[None] | None = None


class ReportFeed:
    """One per LLMService (its executor's)."""

    def __init__(self, scraper: Scraper, stale_after: float, retry: float) -> None:
        self.scraper = scraper
        self.wait = max(0.0, min(MAX_WAIT_SECONDS, stale_after * 2 / 3))
        self.retry = retry
        self.lines: tuple[int, ...] = ()  # the policy's lines, sent with every poll
        self.wake: Callable[[], None] = lambda: None  # the service loop's wake-up (edge/handlers)
        self._polls: dict[str, _Poll] = {}  # by pod name
        self._read: dict[str, Report] = {}  # pod -> the report the last pass read

    def set_lines(self, lines: Sequence[int]) -> None:
        """The lines a rank's minimum free memory crossing is news (the polls in flight keep the
        old ones until they are answered, at most `wait` seconds)."""
        self.lines = tuple(sorted(set(lines)))

    async def read(self, targets: Sequence[Target]) -> Scrape:
        """The latest answer of every target's agent, for a pass; polls start for new targets
        (waited for, up to the scrape timeout) and stop for targets gone."""
        wanted = {t.pod: t for t in targets}
        for pod, poll in list(self._polls.items()):
            if wanted.get(pod) != poll.target or (poll.task is not None and poll.task.done()):
                self._stop(pod)  # gone, moved, or its task ended (a bug, logged): started afresh
        self.scraper.keep_only(targets)
        fresh = [self._start(t) for t in targets if t.pod not in self._polls]
        if fresh:
            for p in fresh:
                p.awaited = True
            waits = asyncio.gather(*(p.answered.wait() for p in fresh))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(waits, (TIMEOUT.total or 2.0) + 1.0)
            for p in fresh:
                p.awaited = False  # one that answers later wakes the loop as any news does
        scrape = Scrape()
        for t in targets:
            latest = self._polls[t.pod].latest
            if isinstance(latest, Scraped):
                scrape.reports.append(latest)
            elif isinstance(latest, AgentMiss):
                scrape.misses.append(latest)
        self._read = {s.pod: s.report for s in scrape.reports}
        return scrape

    def polled(self) -> list[str]:
        """The pods whose agents are being polled now."""
        return sorted(self._polls)

    def _start(self, target: Target) -> _Poll:
        poll = self._polls[target.pod] = _Poll(target)
        poll.task = asyncio.ensure_future(self._run(poll))
        return poll

    def _stop(self, pod: str) -> None:
        poll = self._polls.pop(pod, None)
        if poll is not None and poll.task is not None:
            poll.task.cancel()
        self._read.pop(pod, None)

    async def close(self) -> None:
        """Stop every poll (the service's loop ended, or restarts)."""
        tasks = [p.task for p in self._polls.values() if p.task is not None]
        self._polls.clear()
        self._read.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _run(self, poll: _Poll) -> None:
        try:
            await self._polling(poll)
        except asyncio.CancelledError:
            raise
        except Exception:  # the next pass starts it again (read); the pass keeps what it had
            log.exception("the long-poll of pod %s's agent failed", poll.target.pod)

    async def _polling(self, poll: _Poll) -> None:
        pod, token = poll.target.pod, None
        while True:
            query = {"wait": f"{self.wait:g}"}
            if token is not None:
                query["since"] = token
            if self.lines:
                query["lines"] = ",".join(str(v) for v in self.lines)
            timeout = aiohttp.ClientTimeout(total=self.wait + ANSWER_GRACE_SECONDS, connect=1.0)
            got = await self.scraper.poll(poll.target, query, timeout)
            before, poll.latest = poll.latest, got
            poll.answered.set()
            if isinstance(got, AgentMiss):
                token = None
                said = (before.kind, before.detail) if isinstance(before, AgentMiss) else None
                if not poll.awaited and said != (got.kind, got.detail):
                    self.wake()
                await asyncio.sleep(self.retry)
                continue
            token = got.token
            if not poll.awaited and (
                isinstance(before, AgentMiss) or news(self._read.get(pod), got.report, self.lines) is not None
            ):
                self.wake()
            if token is None:
                await asyncio.sleep(self.retry)  # an agent without the long-poll: asked at intervals
