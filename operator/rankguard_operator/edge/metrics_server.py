"""Serve the operator's Prometheus metrics (prometheus_client's own HTTP server)."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger("rankguard_operator")
_started = False


def start_metrics_server(host: str, port: int) -> None:
    """Start once per process; port 0 means off."""
    global _started
    if _started or port == 0:
        return
    try:
        start_http_server(port, addr=host)
    except OSError as e:
        # A clash must not stop the operator from keeping GPUs out of OOM; say it once.
        log.error("metrics endpoint %s:%d not started: %s", host, port, e)
        return
    _started = True
    log.info("metrics at http://%s:%d/metrics", host, port)
