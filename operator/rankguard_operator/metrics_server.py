"""Serve the operator's Prometheus metrics on RANKGUARD_METRICS_PORT (default 9090; 0 = off)."""

from __future__ import annotations

import logging
import os

from prometheus_client import start_http_server

log = logging.getLogger("rankguard_operator")
_started = False


def start_metrics_server() -> None:
    global _started
    port = int(os.environ.get("RANKGUARD_METRICS_PORT", "9090"))
    if _started or port == 0:
        return
    host = os.environ.get("RANKGUARD_METRICS_HOST", "0.0.0.0")
    try:
        start_http_server(port, addr=host)
    except OSError as e:
        # A clash must not stop the operator from keeping GPUs out of OOM; say it once.
        log.error("metrics endpoint %s:%d not started: %s", host, port, e)
        return
    _started = True
    log.info("metrics at http://%s:%d/metrics", host, port)
