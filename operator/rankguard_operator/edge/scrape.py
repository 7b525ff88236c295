"""Fetch `/report` from every ready serving pod's agent (aiohttp client, bounded in every way).

A report that is slow, oversized, malformed or hostile is counted in
`rankguard_operator_reports_rejected_total{reason}` and dropped: it is "no data", never a
reason to act (DESIGN §5). The operator keeps running whatever an agent sends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from rankguard_agent.report import MAX_REPORT_BYTES, Report, ReportError, parse_report

from .metrics import REPORT_FIELDS_DROPPED, REPORTS_OK, REPORTS_REJECTED

log = logging.getLogger("rankguard_operator.edge.scrape")

TIMEOUT = aiohttp.ClientTimeout(total=2.0, connect=1.0)
MAX_CONCURRENCY = 16


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


class Scraper:
    """One per LLMService: a long-lived aiohttp session reused across scrapes."""

    def __init__(self, service: str, namespace: str) -> None:
        self.service, self.namespace = service, namespace
        self._session: aiohttp.ClientSession | None = None
        self._sem = asyncio.Semaphore(MAX_CONCURRENCY)
        self._complained: set[tuple[str, str]] = set()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _reject(self, target: Target, reason: str, detail: str) -> None:
        REPORTS_REJECTED.labels(namespace=self.namespace, llmservice=self.service, reason=reason).inc()
        # Log a bad agent once per pod and reason, not every scrape.
        if (target.pod, reason) not in self._complained:
            self._complained.add((target.pod, reason))
            log.warning("ignoring the report of pod %s (%s): %s", target.pod, reason, detail)

    async def _one(self, target: Target) -> Scraped | None:
        assert self._session is not None
        url = f"http://{target.ip}:{target.port}/report"
        async with self._sem:
            try:
                async with self._session.get(url, allow_redirects=False) as resp:
                    if resp.status != 200:
                        self._reject(target, "http-status", f"HTTP {resp.status}")
                        return None
                    raw = await _read_at_most(resp.content, MAX_REPORT_BYTES + 1)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self._reject(target, "unreachable", f"{type(e).__name__}: {e}")
                return None
        if len(raw) > MAX_REPORT_BYTES:
            self._reject(target, "oversized", f"more than {MAX_REPORT_BYTES} bytes")
            return None
        try:
            report = parse_report(raw)
        # ValueError besides ReportError: json.loads raises a bare ValueError for an integer of
        # more than 4300 digits (Python's int-conversion limit), which parse_report lets through.
        except (ReportError, ValueError) as e:
            self._reject(target, "malformed", str(e))
            return None
        REPORTS_OK.labels(namespace=self.namespace, llmservice=self.service).inc()
        self._complained = {c for c in self._complained if c[0] != target.pod}
        if report.dropped_fields:
            # the report stands; only its malformed advisory fields were dropped (counted, logged)
            REPORT_FIELDS_DROPPED.labels(namespace=self.namespace, llmservice=self.service).inc(
                len(report.dropped_fields)
            )
            log.debug("pod %s: dropped from its report: %s", target.pod, "; ".join(report.dropped_fields))
        return Scraped(target.pod, report, time.time())

    async def scrape(self, targets: Sequence[Target]) -> list[Scraped]:
        if not targets:
            return []
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=TIMEOUT, raise_for_status=False)
        results = await asyncio.gather(*(self._one(t) for t in targets))
        return [r for r in results if r is not None]
