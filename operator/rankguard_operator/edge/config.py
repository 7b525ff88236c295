"""The operator's configuration: one object, built once at start-up from the environment.

Environment (all optional):
  RANKGUARD_WATCH_NAMESPACES  comma-separated namespaces (or globs) to watch; empty = all.
                              Names narrow the watches themselves; a glob makes them
                              cluster-wide, filtered by the handlers (`watches`)
  RANKGUARD_AGENT_IMAGE       image of the agent-install init container in serving pods
  RANKGUARD_LIVENESS_HOST/PORT  kopf's liveness endpoint /healthz (default 0.0.0.0:8080; 0 = off)
  RANKGUARD_METRICS_HOST/PORT   Prometheus metrics (default 0.0.0.0:9090; 0 = off)
  RANKGUARD_SCRAPE_INTERVAL   seconds between passes of a service with a remediation under way
                              or pods starting, and between asks of an agent whose poll failed
                              or that cannot long-poll (default 2)
  RANKGUARD_RESYNC_INTERVAL   seconds between passes of any other service, when no watch event
                              or agent news wakes it sooner (default 30)
  RANKGUARD_STALE_AFTER       seconds after which an agent report is too old to act on (default
                              30); an agent's held poll is answered within two thirds of it
  RANKGUARD_AGENT_UNAVAILABLE_AFTER  seconds a ready serving pod may go without a valid agent
                              report before AgentReady turns False (default 60)
  RANKGUARD_LOG_FORMAT        plain | json (default plain)
  RANKGUARD_LOG_LEVEL         debug | info | warning | error (default info)
  RANKGUARD_LEADER_ELECTION   true | false (default false; the chart turns it on): hold a
                              coordination.k8s.io Lease before acting, so that of several
                              replicas exactly one acts (edge/leader.py)
  RANKGUARD_LEASE_NAME        the Lease's name (default rankguard-operator)
  RANKGUARD_LEASE_NAMESPACE   its namespace (default: the pod's own, else "default")
  RANKGUARD_POD_NAME          this replica's name in the Lease (default: the host name)

A bad value stops the operator at start-up with one line naming the variable, rather than
being discovered later in a loop.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rankguard_operator.core.names import DEFAULT_AGENT_IMAGE
from rankguard_operator.core.step import Settings

DEFAULT_LEASE_NAME = "rankguard-operator"
LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
# where a pod's own namespace is, in every Kubernetes pod with a service account token
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ConfigError(ValueError):
    """A RANKGUARD_* variable has a value the operator cannot use; the message names it."""


def _port(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key, str(default)).strip()
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a port number (0 turns the endpoint off)") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{key}={port} is outside 0-65535 (0 turns the endpoint off)")
    return port


def _seconds(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key, str(default)).strip()
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}={raw!r} must be a positive number of seconds")
    return value


@dataclass(frozen=True)
class OperatorConfig:
    watch_namespaces: tuple[str, ...] = ()
    agent_image: str = DEFAULT_AGENT_IMAGE
    liveness_host: str = "0.0.0.0"
    liveness_port: int = 8080
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 9090
    scrape_interval: float = 2.0
    resync_interval: float = 30.0
    stale_after: float = 30.0
    agent_unavailable_after: float = 60.0
    log_format: str = "plain"
    log_level: str = "info"
    leader_election: bool = False
    lease_name: str = DEFAULT_LEASE_NAME
    lease_namespace: str = "default"
    identity: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> OperatorConfig:
        fmt = env.get("RANKGUARD_LOG_FORMAT", "plain").strip() or "plain"
        if fmt not in ("plain", "json"):
            raise ConfigError(f"RANKGUARD_LOG_FORMAT={fmt!r} must be plain or json")
        level = env.get("RANKGUARD_LOG_LEVEL", "info").strip().lower() or "info"
        if level not in LOG_LEVELS:
            raise ConfigError(f"RANKGUARD_LOG_LEVEL={level!r} must be one of {', '.join(LOG_LEVELS)}")
        elect = env.get("RANKGUARD_LEADER_ELECTION", "false").strip().lower() or "false"
        if elect not in ("true", "false"):
            raise ConfigError(f"RANKGUARD_LEADER_ELECTION={elect!r} must be true or false")
        namespaces = tuple(
            n.strip() for n in env.get("RANKGUARD_WATCH_NAMESPACES", "").split(",") if n.strip()
        )
        return cls(
            watch_namespaces=namespaces,
            agent_image=env.get("RANKGUARD_AGENT_IMAGE", "").strip() or DEFAULT_AGENT_IMAGE,
            liveness_host=env.get("RANKGUARD_LIVENESS_HOST", "0.0.0.0").strip() or "0.0.0.0",
            liveness_port=_port(env, "RANKGUARD_LIVENESS_PORT", 8080),
            metrics_host=env.get("RANKGUARD_METRICS_HOST", "0.0.0.0").strip() or "0.0.0.0",
            metrics_port=_port(env, "RANKGUARD_METRICS_PORT", 9090),
            scrape_interval=_seconds(env, "RANKGUARD_SCRAPE_INTERVAL", 2.0),
            resync_interval=_seconds(env, "RANKGUARD_RESYNC_INTERVAL", 30.0),
            stale_after=_seconds(env, "RANKGUARD_STALE_AFTER", 30.0),
            agent_unavailable_after=_seconds(env, "RANKGUARD_AGENT_UNAVAILABLE_AFTER", 60.0),
            log_format=fmt,
            log_level=level,
            leader_election=elect == "true",
            lease_name=env.get("RANKGUARD_LEASE_NAME", "").strip() or DEFAULT_LEASE_NAME,
            lease_namespace=env.get("RANKGUARD_LEASE_NAMESPACE", "").strip() or _own_namespace(),
            identity=env.get("RANKGUARD_POD_NAME", "").strip() or socket.gethostname(),
        )

    @property
    def logging_level(self) -> int:
        return LOG_LEVELS[self.log_level]

    @property
    def uses_namespace_patterns(self) -> bool:
        """Some of the namespaces to watch are globs (`team-*`), not names."""
        return any(ch in ns for ns in self.watch_namespaces for ch in "*?[")

    def watches(self, namespace: str | None) -> bool:
        """Whether objects in `namespace` are this operator's: the handlers' filter, which is what
        narrows a cluster-wide watch to the globs (see kopf_args)."""
        if not self.watch_namespaces:
            return True
        return namespace is not None and any(fnmatch.fnmatchcase(namespace, g) for g in self.watch_namespaces)

    @property
    def settings(self) -> Settings:
        """What each reconcile step needs."""
        return Settings(
            agent_image=self.agent_image,
            stale_after=self.stale_after,
            agent_unavailable_after=self.agent_unavailable_after,
        )

    def kopf_args(self) -> dict[str, object]:
        """What to hand kopf.operator()."""
        # Globs are matched by our handlers' filter (`watches`) on a cluster-wide watch, not by
        # kopf's namespace scanning: kopf lists the namespaces once, then starts a watch whose own
        # first listing it ignores, so a namespace created between the two is never watched (an
        # operator started as a namespace is created served nothing in it; seen in the e2e tier).
        exact = not self.uses_namespace_patterns
        return {
            "standalone": True,
            "clusterwide": not (exact and self.watch_namespaces),
            "namespaces": list(self.watch_namespaces) if exact else [],
            "liveness_endpoint": (
                f"http://{self.liveness_host}:{self.liveness_port}/healthz" if self.liveness_port else None
            ),
        }


def _own_namespace() -> str:
    try:
        return POD_NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"
