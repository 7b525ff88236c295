"""Fetch `/report` from every ready serving pod's agent (aiohttp client, bounded in every way).

A report that is slow, oversized, malformed or hostile is counted in
`rankguard_operator_reports_rejected_total{reason}` and dropped: it is "no data", never a
reason to act (DESIGN §5). The operator keeps running whatever an agent sends.

Each pass also says, per pod, why its report is missing (`AgentMiss`: unreachable, the
agent's fallback answering 503 with `{"agentError": ...}`, another status, oversized,
malformed) and since when it has been missing without a break, for the AgentReady
condition (core/observe/agent_ready). Of a 503's body only a bounded read of `agentError` is used,
as a string, cut to one short line; nothing else in it is trusted.

One aiohttp session (one connection pool) and one concurrency bound serve every LLMService of
the operator: at a thousand services, a session each would hold a thousand pools and let a
burst of passes open thousands of sockets at once. The long-polls of edge/report_feed are held
open for up to 20 s each, one per serving pod: they have a pool and a bound of their own
(`MAX_HELD_POLLS`), so a thousand held polls never starve a one-shot scrape, nor the other way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from rankguard_agent.wire.change import REPORT_TOKEN_HEADER, clean_token
from rankguard_agent.wire.report import MAX_REPORT_BYTES, Report, ReportError, parse_report
from rankguard_operator.core.observe.agent_ready import AgentMiss, MissKind, clean_agent_error
from rankguard_operator.edge.metrics import REPORT_FIELDS_DROPPED, REPORTS_OK, REPORTS_REJECTED

log = logging.getLogger("rankguard_operator.edge.scrape")

TIMEOUT = aiohttp.ClientTimeout(total=2.0, connect=1.0)
MAX_CONCURRENCY = 64  # scrapes in flight at once, for the whole operator
MAX_ERROR_BODY = 4096  # bytes of a 503 read for its agentError; the rest is never read
# Long-polls held at once, for the whole operator: one per serving pod, so 4,096 pods (1,000 TP8
# services are 1,000 pods; a multi-node group is a few pods). A pod beyond it waits for a slot,
# and its report turns stale meanwhile: the AgentReady condition says so.
MAX_HELD_POLLS = 4096


@dataclass(frozen=True)
class Target:
    pod: str
    ip: str
    port: int


@dataclass(frozen=True)
class Scraped:
    pod: str
    report: Report
    received_at: float
    token: str | None = None  # the agent's name for this answer, for its next long-poll (`since`)


@dataclass(frozen=True)
class Scrape:
    """One pass's scrape: the valid reports, and why the other targets sent none."""

    reports: list[Scraped] = field(default_factory=list)
    misses: list[AgentMiss] = field(default_factory=list)


def agent_error_of(body: bytes) -> str | None:
    """The fallback's `agentError`, cleaned; None when the body is not such a JSON object."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return clean_agent_error(doc.get("agentError")) if isinstance(doc, dict) else None


async def _read_at_most(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """Up to `limit` bytes of a body. One `StreamReader.read(n)` returns as soon as any data is
    buffered (often a single 64 KiB chunk), which would cut a larger report short."""
    raw = bytearray()
    while len(raw) < limit:
        chunk = await stream.read(limit - len(raw))
        if not chunk:
            break
        raw += chunk
    return bytes(raw)


@dataclass
class _Shared:
    session: aiohttp.ClientSession
    bound: asyncio.Semaphore
    polls: aiohttp.ClientSession  # the long-polls' own pool (its timeouts are per request)
    poll_bound: asyncio.Semaphore


# Per event loop (the operator has one; tests start several in turn): a session and a
# semaphore belong to the loop they were made in.
_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Shared] = weakref.WeakKeyDictionary()


def _shared() -> _Shared:
    loop = asyncio.get_running_loop()
    shared = _SHARED.get(loop)
    if shared is None or shared.session.closed:
        session = aiohttp.ClientSession(
            timeout=TIMEOUT,
            raise_for_status=False,
            connector=aiohttp.TCPConnector(limit=MAX_CONCURRENCY),
        )
        polls = aiohttp.ClientSession(
            raise_for_status=False, connector=aiohttp.TCPConnector(limit=MAX_HELD_POLLS)
        )
        shared = _SHARED[loop] = _Shared(
            session, asyncio.Semaphore(MAX_CONCURRENCY), polls, asyncio.Semaphore(MAX_HELD_POLLS)
        )
    return shared


async def close_shared_session() -> None:
    """At operator cleanup: close this loop's sessions."""
    shared = _SHARED.pop(asyncio.get_running_loop(), None)
    if shared is not None:
        await shared.session.close()
        await shared.polls.close()


class Scraper:
    """One per LLMService: what it remembers between scrapes (complaints logged, failures in a
    row); the HTTP session is the operator's shared one."""

    def __init__(self, service: str, namespace: str) -> None:
        self.service, self.namespace = service, namespace
        self._complained: set[tuple[str, str]] = set()
        self._failing_since: dict[str, float] = {}  # pod -> its first failed scrape in a row

    async def close(self) -> None:
        """Nothing of its own to close: the session is shared (close_shared_session)."""

    def _reject(self, target: Target, reason: str, detail: str) -> None:
        REPORTS_REJECTED.labels(namespace=self.namespace, llmservice=self.service, reason=reason).inc()
        # Log a bad agent once per pod and reason, not every scrape.
        if (target.pod, reason) not in self._complained:
            self._complained.add((target.pod, reason))
            log.warning("ignoring the report of pod %s (%s): %s", target.pod, reason, detail)

    def _miss(
        self, target: Target, kind: MissKind, detail: str, why: str = "", agent_error: str | None = None
    ) -> AgentMiss:
        """Count and log (once) a missing report; `detail` is the short, stable account the
        condition quotes, `why` the full one for the log."""
        self._reject(target, kind, f"{detail}: {agent_error or why}" if agent_error or why else detail)
        since = self._failing_since.setdefault(target.pod, time.time())
        return AgentMiss(target.pod, kind, detail, since, agent_error)

    async def _one(self, shared: _Shared, target: Target) -> Scraped | AgentMiss:
        return await self.fetch(shared.session, shared.bound, target)

    async def poll(
        self, target: Target, query: dict[str, str], timeout: aiohttp.ClientTimeout
    ) -> Scraped | AgentMiss:
        """One long-poll of `/report` (edge/report_feed): the same checks as a scrape, on the
        long-polls' own pool and bound."""
        shared = _shared()
        return await self.fetch(shared.polls, shared.poll_bound, target, query, timeout)

    async def fetch(
        self,
        session: aiohttp.ClientSession,
        bound: asyncio.Semaphore,
        target: Target,
        query: dict[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> Scraped | AgentMiss:
        host = f"[{target.ip}]" if ":" in target.ip else target.ip  # an IPv6 pod IP
        url = f"http://{host}:{target.port}/report"
        token: str | None = None
        async with bound:
            try:
                async with session.get(
                    url, params=query, allow_redirects=False, timeout=timeout or TIMEOUT
                ) as resp:
                    token = clean_token(resp.headers.get(REPORT_TOKEN_HEADER))
                    if resp.status == 503:
                        # the agent's fallback: vLLM runs, the agent could not start, and says why
                        said = agent_error_of(await _read_at_most(resp.content, MAX_ERROR_BODY))
                        if said is not None:
                            return self._miss(target, "agent-error", "HTTP 503", agent_error=said)
                    if resp.status != 200:
                        return self._miss(target, "http-status", f"HTTP {resp.status}")
                    raw = await _read_at_most(resp.content, MAX_REPORT_BYTES + 1)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                return self._miss(target, "unreachable", f"unreachable: {type(e).__name__}", str(e))
        if len(raw) > MAX_REPORT_BYTES:
            return self._miss(target, "oversized", f"its report is over {MAX_REPORT_BYTES} bytes")
        try:
            report = parse_report(raw)
        # ValueError besides ReportError: json.loads raises a bare ValueError for an integer of
        # more than 4300 digits (Python's int-conversion limit), which parse_report lets through.
        except (ReportError, ValueError) as e:
            return self._miss(target, "malformed", "its report is malformed", str(e))
        REPORTS_OK.labels(namespace=self.namespace, llmservice=self.service).inc()
        self._complained = {c for c in self._complained if c[0] != target.pod}
        self._failing_since.pop(target.pod, None)
        if report.dropped_fields:
            # the report stands; only its malformed advisory fields were dropped (counted, logged)
            REPORT_FIELDS_DROPPED.labels(namespace=self.namespace, llmservice=self.service).inc(
                len(report.dropped_fields)
            )
            log.debug("pod %s: dropped from its report: %s", target.pod, "; ".join(report.dropped_fields))
        return Scraped(target.pod, report, time.time(), token)

    def keep_only(self, targets: Sequence[Target]) -> None:
        """Forget pods that are no longer targets: a pod back later starts a new run of failures."""
        pods = {t.pod for t in targets}
        self._failing_since = {p: since for p, since in self._failing_since.items() if p in pods}

    async def scrape(self, targets: Sequence[Target]) -> Scrape:
        self.keep_only(targets)
        if not targets:
            return Scrape()
        shared = _shared()
        results = await asyncio.gather(*(self._one(shared, t) for t in targets))
        return Scrape(
            [r for r in results if isinstance(r, Scraped)], [r for r in results if isinstance(r, AgentMiss)]
        )
