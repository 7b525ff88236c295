"""An API server outage is one warning, counted, not a traceback per service per pass.

The drill that found it: 3 services, the API server down for 55 s, 12,564 log lines, because
urllib3's connection errors escaped the temporary-error path and were logged as "unexpected
error" with a traceback by every service's loop on every pass. Here the real kubernetes client
calls a port nothing listens on.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator

import pytest
from kubernetes import client
from prometheus_client import REGISTRY

from rankguard_operator.edge import k8s
from rankguard_operator.edge.api_health import HEALTH, KopfRetryFilter
from rankguard_operator.edge.metrics import API_ERRORS, API_OUTAGES, API_REACHABLE
from rankguard_sim.kube.cluster import free_port


@pytest.fixture
def unreachable_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    conf = client.Configuration(host=f"https://127.0.0.1:{free_port()}")
    conf.retries = 0  # urllib3 would retry three times; the outcome is the same, only slower
    api = client.ApiClient(conf)
    monkeypatch.setattr(k8s, "_api", api)
    monkeypatch.setattr(HEALTH, "down_since", None)
    monkeypatch.setattr(HEALTH, "failed_calls", 0)
    monkeypatch.setattr(HEALTH, "last_ok", None)
    try:
        yield
    finally:
        api.close()


def _value(metric: object, **labels: str) -> float:
    name = {
        API_REACHABLE: "rankguard_operator_api_reachable",
        API_OUTAGES: "rankguard_operator_api_outages_total",
    }
    if metric is API_ERRORS:
        return REGISTRY.get_sample_value("rankguard_operator_api_errors_total", labels) or 0.0
    return REGISTRY.get_sample_value(name[metric]) or 0.0  # type: ignore[index]


async def test_calls_during_an_outage_raise_api_unavailable_and_log_one_warning(
    unreachable_api: None, caplog: pytest.LogCaptureFixture
) -> None:
    errors, outages = _value(API_ERRORS, kind="unreachable"), _value(API_OUTAGES)
    with caplog.at_level(logging.INFO, logger="rankguard_operator"):
        for _ in range(3):
            with pytest.raises(k8s.ApiUnavailable):
                await k8s.get_claim("ns", "cache")
            with pytest.raises(k8s.ApiUnavailable):
                await k8s.patch_status("ns", "svc", {"phase": "Running"})
    lines = [r for r in caplog.records if r.name.startswith("rankguard_operator")]
    assert [(r.levelname, r.getMessage().split(" (")[0]) for r in lines] == [
        ("WARNING", "API server unreachable")
    ]
    assert not any(r.exc_info for r in caplog.records)  # no traceback anywhere
    assert _value(API_ERRORS, kind="unreachable") == errors + 6
    assert _value(API_OUTAGES) == outages + 1
    assert _value(API_REACHABLE) == 0
    assert HEALTH.failed_calls == 6

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rankguard_operator"):
        HEALTH.succeeded()
        HEALTH.succeeded()  # only the first success after an outage is news
    assert [r.getMessage() for r in caplog.records] == [
        "API server reachable again after 0 s (6 calls failed meanwhile)"
    ]
    assert _value(API_REACHABLE) == 1


def test_kopfs_retry_lines_are_folded_into_the_outage_and_others_pass() -> None:
    folded = KopfRetryFilter()

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord(
            "kopf._cogs.clients.watching", logging.ERROR, __file__, 1, message, None, None
        )

    HEALTH.down_since, HEALTH.failed_calls = None, 0
    try:
        # as kopf/_cogs/clients/api.py words them
        pods = "GET https://127.0.0.1:6443/api/v1/pods"
        retry = f"Request attempt #2/9 failed; will retry: {pods} -> ClientConnectorError()"
        last = f"Request attempt #9/9 failed; escalating: {pods} -> ServerDisconnectedError()"
        assert folded.filter(record(retry)) is False
        assert folded.filter(record(last)) is False
        assert HEALTH.down and HEALTH.failed_calls == 2
        # the API server answered: a refusal or throttling is not an outage, and keeps its line
        forbidden = f"Request attempt #1/9 failed; will retry: {pods} -> APIForbiddenError('forbidden')"
        assert folded.filter(record(forbidden)) is True
        assert folded.filter(record("Handler 'service_daemon' failed with an exception.")) is True
    finally:
        HEALTH.succeeded()


async def test_the_outage_is_dated_from_the_first_failed_call_not_from_its_last_retry(
    unreachable_api: None, caplog: pytest.LogCaptureFixture
) -> None:
    # issue 50: an etcd outage of ~51 s logged as "reachable again after 7 s". A call to a dead
    # API server fails only after the client's timeouts and retries; the outage began when the
    # call was made. Here the client's call gives up after 2 s, as urllib3's would after its
    # retries.
    made = time.monotonic()

    def gives_up_late() -> None:
        # the call fails once 2 s have passed since it was made (waits on the clock, bounded)
        while time.monotonic() < made + 2.0:
            time.sleep(0.05)
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(k8s.ApiUnavailable):
        await k8s._call("get deployments", gives_up_late)
    with caplog.at_level(logging.INFO, logger="rankguard_operator"):
        HEALTH.succeeded()
    [line] = [r.getMessage() for r in caplog.records if "reachable again" in r.getMessage()]
    # at least the 2 s the call took (more on a slow machine, never the moment it gave up)
    said = re.fullmatch(r"API server reachable again after (\d+) s \(1 calls failed meanwhile\)", line)
    assert said is not None and int(said.group(1)) >= 2, line


def test_a_call_made_before_the_last_success_does_not_date_the_outage_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(HEALTH, "down_since", None)
    monkeypatch.setattr(HEALTH, "failed_calls", 0)
    start = time.monotonic()
    HEALTH.succeeded()  # a call answered after `start - 60` was made: the server was up then
    HEALTH.failed("watch", "OSError", since=start - 60)
    assert HEALTH.down_since is not None and HEALTH.down_since >= start
    with caplog.at_level(logging.INFO, logger="rankguard_operator"):
        HEALTH.succeeded()
    assert caplog.records[-1].getMessage().startswith("API server reachable again after 0 s")
