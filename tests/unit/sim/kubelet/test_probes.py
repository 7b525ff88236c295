"""Container probes as the process kubelet runs them: parsing with the API's defaults, when a
check is due and when its result flips, and the HTTP and TCP checks themselves.

Readiness gates the operator's view of a pod, so the timer's thresholds match the kubelet's
prober; the checks run against a local server on loopback.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from rankguard_sim.kubelet.pod.spec import SpecError
from rankguard_sim.kubelet.probes import ProbeSpec, ProbeTimer, check_http, check_tcp, parse_probe

# ------------------------------------------------------------------------------ probes


def test_probe_parsing_uses_api_defaults_and_named_ports() -> None:
    container = {"ports": [{"name": "http", "containerPort": 8000}]}
    spec = parse_probe({"httpGet": {"port": "http", "path": "/health"}}, container)
    assert (spec.kind, spec.port, spec.path, spec.period, spec.timeout, spec.failure_threshold) == (
        "httpGet",
        8000,
        "/health",
        10.0,
        1.0,
        3,
    )
    assert parse_probe({"tcpSocket": {"port": 22}, "periodSeconds": 2}, container).period == 2.0
    with pytest.raises(SpecError, match="no port named"):
        parse_probe({"httpGet": {"port": "metrics"}}, container)


def test_probe_timer_waits_for_initial_delay_then_needs_thresholds_to_flip() -> None:
    spec = ProbeSpec(kind="httpGet", initial_delay=5, period=1, success_threshold=2, failure_threshold=3)
    readiness = ProbeTimer(spec, started_at=100, initial=False)
    assert not readiness.due(104.9) and readiness.due(105)
    assert readiness.record(True, 105) is False and readiness.result is False  # 1 of 2 successes
    assert not readiness.due(105.5)
    assert readiness.record(True, 106) is True and readiness.result is True
    assert readiness.record(False, 107) is False and readiness.record(False, 108) is False
    assert readiness.record(True, 109) is False  # a success resets the failure streak
    flips = [readiness.record(False, t) for t in (110, 111, 112)]
    assert flips == [False, False, True] and readiness.result is False and readiness.failed_out


@pytest.fixture
def http_server() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ok" else 500)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_http_and_tcp_checks(http_server: int) -> None:
    assert check_http(ProbeSpec(kind="httpGet", port=http_server, path="/ok"), "127.0.0.1") == (True, "")
    ok, msg = check_http(ProbeSpec(kind="httpGet", port=http_server, path="/bad"), "127.0.0.1")
    assert not ok and "statuscode: 500" in msg
    assert check_tcp(ProbeSpec(kind="tcpSocket", port=http_server), "127.0.0.1")[0]
    closed = ProbeSpec(kind="tcpSocket", port=http_server, host="127.0.0.3")  # nothing listens there
    assert not check_tcp(closed, "127.0.0.1")[0]
