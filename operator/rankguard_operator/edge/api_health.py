"""Whether the API server answers, for the whole operator: one warning per outage, not one per
service per pass.

While the API server (or the etcd behind it) is down, every LLMService's loop and every kopf
watch fails at once. Logged one by one that is thousands of lines a minute with tracebacks,
which buries the one fact a person needs. Instead every failed call reports here: the first
failure of an outage logs one WARNING ("API server unreachable"), later failures only count
(`rankguard_operator_api_errors_total`), and the first success logs one INFO ("API server
reachable again after N s", N counted from when the first failed call was made, not from when
it gave up: a call to a dead API server fails only after the client's connect timeouts and
retries, which can be most of the outage). While down, one probe (`GET /readyz`, which every authenticated
account may read) runs for the whole operator, so recovery is noticed even when no loop has
anything to call. kopf's own request retries are folded in by `KopfRetryFilter`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable

from rankguard_operator.edge.metrics import API_ERRORS, API_OUTAGES, API_REACHABLE

log = logging.getLogger("rankguard_operator.api")

PROBE_SECONDS = 5.0  # between probes while the API server is down


class ApiHealth:
    """Operator-wide; `HEALTH` is the one instance."""

    def __init__(self) -> None:
        self.down_since: float | None = None
        self.last_ok: float | None = None  # when a call last succeeded (monotonic)
        self.failed_calls = 0
        self._probe: asyncio.Task[None] | None = None
        self._probe_call: Callable[[], Awaitable[bool]] | None = None
        API_REACHABLE.set(1)

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def use_probe(self, probe: Callable[[], Awaitable[bool]]) -> None:
        """How to ask whether the API server answers again (edge/k8s.readyz)."""
        self._probe_call = probe

    def failed(self, what: str, error: str, kind: str = "unreachable", since: float | None = None) -> None:
        """`since`: when the failed call was made (time.monotonic), when the caller knows; the
        outage is dated from the earliest failed call, but never before the last success."""
        API_ERRORS.labels(kind=kind).inc()
        self.failed_calls += 1
        began = time.monotonic() if since is None else since
        if self.last_ok is not None:
            began = max(began, self.last_ok)
        if self.down_since is not None:
            self.down_since = min(self.down_since, began)
            return
        self.down_since = began
        API_REACHABLE.set(0)
        API_OUTAGES.inc()
        log.warning(
            "API server unreachable (%s: %s); every LLMService's loop waits and retries, "
            "nothing is decided until it answers again",
            what,
            error,
        )
        self._start_probe()

    def succeeded(self) -> None:
        now = time.monotonic()
        self.last_ok = now
        if self.down_since is None:
            return
        took = now - self.down_since
        log.info(
            "API server reachable again after %.0f s (%d calls failed meanwhile)", took, self.failed_calls
        )
        self.down_since, self.failed_calls = None, 0
        API_REACHABLE.set(1)

    def _start_probe(self) -> None:
        if self._probe_call is None or (self._probe is not None and not self._probe.done()):
            return
        with contextlib.suppress(RuntimeError):  # no running loop (a unit test): nothing to probe
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())

    async def _probe_until_up(self) -> None:
        assert self._probe_call is not None
        while self.down:
            await asyncio.sleep(PROBE_SECONDS)
            if await self._probe_call():
                self.succeeded()

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe


HEALTH = ApiHealth()

# kopf's request retries, as kopf/_cogs/clients/api.py logs them: "Request attempt #2/9 failed;
# will retry: GET https://... -> ClientConnectorError(...)" (and "escalating" for the last one).
_KOPF_RETRY = re.compile(
    r"^Request attempt #?\S+ failed; (?:will retry|escalating): (\S+ \S+) -> (.*)$", re.S
)


class KopfRetryFilter(logging.Filter):
    """Turns kopf's per-attempt request errors into HEALTH failures instead of log lines: kopf
    retries its watches by itself, so each attempt is not news; the outage is, once."""

    def filter(self, record: logging.LogRecord) -> bool:
        match = _KOPF_RETRY.match(record.getMessage())
        if match is None:
            return True
        error = match.group(2)
        if "Forbidden" in error or "TooManyRequests" in error:
            return True  # the API server answered: not an outage, and worth its own line
        HEALTH.failed(f"kopf {match.group(1)}", error[:200])
        return False
