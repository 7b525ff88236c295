"""The sandbox's calls to the API server: plain dicts in and out (`raw_call`), as everywhere in the
sandbox, and one warning per distinct message per interval for API trouble (`Throttled`), so a
control plane that stops answering cannot flood the logs. Used by the process kubelet and the
storage provisioner alike.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rankguard_sim.kubelet")


def raw_call(call: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call the API and return the JSON body as a dict (the sim works on plain dicts)."""
    resp = call(*args, _preload_content=False, **kwargs)
    try:
        doc = json.loads(resp.data)
    finally:
        resp.release_conn()
    return doc if isinstance(doc, dict) else {}


class Throttled:
    """Logs one warning per distinct message per interval: API trouble must not flood logs."""

    def __init__(self, every: float = 30.0) -> None:
        self.every = every
        self._last: dict[str, float] = {}

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(msg, -1e9) >= self.every:
            self._last[msg] = now
            log.warning(msg, *args)
