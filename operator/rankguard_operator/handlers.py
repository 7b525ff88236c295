"""kopf handlers: thin. They gather inputs, call the pure core, and apply what it decided.

One long-lived daemon per LLMService runs the loop of DESIGN §2 (observe → decide → act).
Pod and Deployment events only wake that daemon, so a CUDA OOM reaches the policy within
one API round trip, while the loop itself stays level-triggered: every pass re-reads the
world and is idempotent, so a lost or repeated event changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import kopf

from . import k8s
from .loop import ServiceLoop
from .metrics_server import start_metrics_server

log = logging.getLogger("rankguard_operator")

MANAGED = {"app.kubernetes.io/managed-by": "rankguard"}
SERVICE_LABEL = "rankguard.io/llmservice"
SCRAPE_INTERVAL = float(os.environ.get("RANKGUARD_SCRAPE_INTERVAL", "2"))

# (namespace, name) -> the event that wakes that service's loop early.
_wakers: dict[tuple[str, str], asyncio.Event] = {}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations under our own prefix: the CRD's status schema
    # is structural, so kopf's default status.kopf field would be pruned anyway.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="rankguard.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="rankguard.io", key="last-handled-configuration"
    )
    settings.posting.level = logging.ERROR  # Events are posted deliberately, not from log lines
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.peering.standalone = True
    # kopf scans CRDs and namespaces to resolve namespace patterns (`team-*`). Exact names or
    # all namespaces need no scan, and the chart's account may not list either (least
    # privilege, docs/rbac.md); a pattern needs namespaces list/watch, documented there.
    settings.scanning.disabled = not uses_namespace_patterns(os.environ.get("RANKGUARD_WATCH_NAMESPACES", ""))
    k8s.login()
    start_metrics_server()


@kopf.index("", "v1", "pods", labels=MANAGED)
def serving_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Pods by (namespace, LLMService name): the loop reads them from memory, not the API."""
    service = labels.get(SERVICE_LABEL)
    if not service:
        return {}
    meta = body.get("metadata", {})
    pod = {
        "metadata": {
            "name": meta.get("name"),
            "uid": meta.get("uid"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": dict(meta.get("annotations") or {}),
            "deletionTimestamp": meta.get("deletionTimestamp"),
        },
        "status": dict(body.get("status") or {}),
    }
    return {(namespace, service): pod}


def uses_namespace_patterns(watch: str) -> bool:
    """True when RANKGUARD_WATCH_NAMESPACES holds a glob pattern rather than exact names."""
    return any(ch in watch for ch in "*?[")


def _wake(namespace: str | None, labels: kopf.Labels) -> None:
    event = _wakers.get((namespace or "", labels.get(SERVICE_LABEL, "")))
    if event is not None:
        event.set()


@kopf.on.event("", "v1", "pods", labels=MANAGED)
def pod_changed(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    _wake(namespace, labels)


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def deployment_changed(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    _wake(namespace, labels)


@kopf.daemon(k8s.GROUP, k8s.VERSION, k8s.PLURAL, cancellation_timeout=15)
async def service_daemon(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    **kwargs: Any,
) -> None:
    # kopf passes each index as a keyword named after its function.
    serving_pods: kopf.Index[Any, Any] = kwargs["serving_pods"]
    assert namespace is not None  # LLMService is namespaced
    key = (namespace, name)
    wake = asyncio.Event()
    _wakers[key] = wake
    loop = ServiceLoop(name, namespace, body)
    try:
        while not stopped:
            wake.clear()
            started = time.monotonic()
            try:
                pods = list(serving_pods.get(key, []))
                await loop.run_once(pods)
            except kopf.TemporaryError as e:
                log.warning("LLMService %s/%s: %s (will retry)", namespace, name, e)
            except kopf.PermanentError as e:
                log.error("LLMService %s/%s: %s", namespace, name, e)
            except Exception:
                # Never let one service's surprise kill its loop: log it, back off, go on.
                log.exception("LLMService %s/%s: unexpected error in the reconcile loop", namespace, name)
            spent = time.monotonic() - started
            await _sleep_until(wake, stopped, max(0.05, SCRAPE_INTERVAL - spent))
    finally:
        _wakers.pop(key, None)
        await loop.close()


async def _sleep_until(wake: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> None:
    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
