"""Defaults shared by the agent's command line, launcher and docs."""

from __future__ import annotations

DEFAULT_PORT = 9404  # the operator scrapes http://<pod-ip>:9404/report (its spec.agent.port default)
DEFAULT_HOST = "0.0.0.0"  # every interface: the operator scrapes the pod IP
DEFAULT_TERMINATION_LOG = "/dev/termination-log"
MAX_SCAN_LINE = 64 * 1024  # lines longer than this are cut for scanning, never for passthrough
DRAIN_SECONDS = 5.0  # after the child exits, how long its grandchildren may keep the pipes open
