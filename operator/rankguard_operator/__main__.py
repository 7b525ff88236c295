"""`python -m rankguard_operator`: run the operator (kopf, standalone, no peering).

Environment:
  RANKGUARD_WATCH_NAMESPACES  comma-separated namespaces to watch; empty = all namespaces
  RANKGUARD_AGENT_IMAGE       image of the agent-install init container in serving pods
  RANKGUARD_LIVENESS_PORT     kopf's liveness endpoint /healthz (default 8080; 0 = off)
  RANKGUARD_METRICS_PORT      Prometheus metrics (default 9090; 0 = off)
  RANKGUARD_SCRAPE_INTERVAL   seconds between observations of each service (default 2)
  RANKGUARD_LOG_FORMAT        plain | json (default plain)
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

import kopf


def kopf_args(env: dict[str, str]) -> dict[str, object]:
    """What to hand kopf.operator(), from the environment (pure, so it is testable)."""
    namespaces = [n.strip() for n in env.get("RANKGUARD_WATCH_NAMESPACES", "").split(",") if n.strip()]
    port = int(env.get("RANKGUARD_LIVENESS_PORT", "8080"))
    host = env.get("RANKGUARD_LIVENESS_HOST", "0.0.0.0")
    return {
        "standalone": True,
        "clusterwide": not namespaces,
        "namespaces": namespaces,
        "liveness_endpoint": f"http://{host}:{port}/healthz" if port else None,
    }


def main() -> int:
    from . import handlers  # noqa: F401, PLC0415 - registers the handlers with kopf

    fmt = os.environ.get("RANKGUARD_LOG_FORMAT", "plain")
    kopf.configure(verbose=False, log_format=kopf.LogFormat.JSON if fmt == "json" else kopf.LogFormat.PLAIN)
    logging.getLogger("rankguard_operator").setLevel(logging.INFO)
    # kopf logs every watch-event handler call ("Handler 'pod_changed' succeeded"): noise here.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    args = kopf_args(dict(os.environ))
    asyncio.run(kopf.operator(**args))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
