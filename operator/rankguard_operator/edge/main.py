"""Start the operator: configuration once, logging, then kopf with our handlers."""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys

import kopf

from rankguard_operator.edge import k8s
from rankguard_operator.edge.config import ConfigError, OperatorConfig
from rankguard_operator.edge.freed_memory import fewer_malloc_arenas
from rankguard_operator.edge.leader import LeaderElector, LeaseClient, StandbyHealth, exit_now
from rankguard_operator.edge.metrics import LEADER
from rankguard_operator.edge.metrics_server import start_metrics_server


def more_open_files() -> int:
    """Raise the soft limit on open files to the hard one: the operator holds one long-poll per
    serving pod (edge/report_feed), and a soft limit of 1,024 (many runtimes' default) would end
    below a thousand services. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
        return hard
    return soft


def run_operator() -> int:
    fewer_malloc_arenas()  # before any thread starts
    more_open_files()
    try:
        config = OperatorConfig.from_env(os.environ)
    except ConfigError as e:
        print(f"rankguard: error: {e}", file=sys.stderr)
        return 2
    from rankguard_operator.edge import handlers  # noqa: F401, PLC0415 - registers the handlers with kopf

    json_logs = config.log_format == "json"
    kopf.configure(verbose=False, log_format=kopf.LogFormat.JSON if json_logs else kopf.LogFormat.PLAIN)
    logging.getLogger("rankguard_operator").setLevel(config.logging_level)
    # kopf logs every watch-event handler call ("Handler 'pod_changed' succeeded"): noise here.
    logging.getLogger("kopf.objects").setLevel(max(logging.WARNING, config.logging_level))
    # aiohttp logs every request to kopf's /healthz: a probe every few seconds is not news.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # the standby's metrics too (rankguard_operator_leader 0), so both replicas can be scraped
    start_metrics_server(config.metrics_host, config.metrics_port)
    elector = _lead(config) if config.leader_election else None
    memo = kopf.Memo(config=config)
    try:
        asyncio.run(kopf.operator(memo=memo, **config.kopf_args()))  # type: ignore[arg-type]
    finally:
        if elector is not None:
            elector.release()
    return 0


def _lead(config: OperatorConfig) -> LeaderElector:
    """Wait as a standby until this replica holds the Lease, then keep renewing it."""
    k8s.login()
    LEADER.set(0)
    standby = StandbyHealth(config.liveness_host, config.liveness_port)
    try:
        elector = LeaderElector(
            LeaseClient(k8s.api(), config.lease_namespace, config.lease_name), config.identity
        )
        elector.acquire()
    finally:
        standby.close()
    elector.keep(on_lost=exit_now)
    return elector
