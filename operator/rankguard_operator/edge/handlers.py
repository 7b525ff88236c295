"""kopf wiring: thin. Watches wake a per-LLMService daemon; the daemon runs the executor.

One long-lived daemon per LLMService runs the loop of DESIGN §2 (observe → decide → act).
Pod, Deployment and spec events only wake that daemon, so a CUDA OOM reaches the policy
within one API round trip, while the loop itself stays level-triggered: every pass re-reads
the world and is idempotent, so a lost or repeated event changes nothing.

Errors are kopf's: an API that is unreachable or throttling raises `kopf.TemporaryError`
out of the daemon, kopf logs it once (no traceback) and restarts the daemon after the
error's delay; anything unexpected is logged with its traceback and retried after
`UNEXPECTED_BACKOFF`. State that must outlive a restart (the executor: scraper session,
Event throttle, the state of its last write) is kept in kopf's per-object `memo`; the
configuration and the wake-up events are in the operator-wide memo.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import kopf

from rankguard_operator.core.names import (
    API_GROUP,
    API_VERSION,
    LLMSERVICE_LABEL,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    PLURAL,
    label_value,
)
from rankguard_operator.edge import k8s
from rankguard_operator.edge.config import OperatorConfig
from rankguard_operator.edge.executor import ServiceExecutor
from rankguard_operator.edge.metrics_server import start_metrics_server

log = logging.getLogger("rankguard_operator")

MANAGED = {MANAGED_BY_LABEL: MANAGED_BY}
UNEXPECTED_BACKOFF = 10.0  # seconds before kopf restarts a daemon after an unexpected error

Key = tuple[str, str]  # (namespace, the LLMService's label value: names.label_value)


def service_key(namespace: str, name: str) -> Key:
    """The pod index's key for an LLMService: its pods carry the label value, not the name
    (a name over 63 characters is shortened in the label)."""
    return (namespace, label_value(name))


def _config(memo: kopf.Memo) -> OperatorConfig:
    config = memo.get("config")
    if not isinstance(config, OperatorConfig):
        # `kopf run -m rankguard_operator.edge.handlers` (tests) starts without __main__.
        config = OperatorConfig.from_env(os.environ)
        memo["config"] = config
    return config


def _wakers(memo: kopf.Memo) -> dict[Key, asyncio.Event]:
    # One dict for the whole operator: per-object memos are shallow copies of the global one.
    wakers: dict[Key, asyncio.Event] = memo.setdefault("wakers", {})
    return wakers


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = _config(memo)
    _wakers(memo)
    # Keep kopf's bookkeeping in annotations under our own prefix: the CRD's status schema
    # is structural, so kopf's default status.kopf field would be pruned anyway.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.ERROR  # Events are posted deliberately, not from log lines
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.peering.standalone = True
    # kopf scans CRDs and namespaces to resolve namespace patterns (`team-*`). Exact names or
    # all namespaces need no scan, and the chart's account may not list either (least
    # privilege, docs/rbac.md); a pattern needs namespaces list/watch, documented there.
    settings.scanning.disabled = not config.uses_namespace_patterns
    k8s.login()
    start_metrics_server(config.metrics_host, config.metrics_port)


@kopf.index("", "v1", "pods", labels=MANAGED)
def serving_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    """Pods by (namespace, the LLMService label value): the loop reads them from memory. Of the
    spec only the node a pod is scheduled on (for its GPU Feature Discovery labels)."""
    service = labels.get(LLMSERVICE_LABEL)
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
        "spec": {"nodeName": (body.get("spec") or {}).get("nodeName")},
        "status": dict(body.get("status") or {}),
    }
    return {(namespace, service): pod}


def _wake(memo: kopf.Memo, namespace: str | None, service_label: str) -> None:
    event = _wakers(memo).get((namespace or "", service_label))
    if event is not None:
        event.set()


@kopf.on.event("", "v1", "pods", labels=MANAGED)
def pod_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    _wake(memo, namespace, labels.get(LLMSERVICE_LABEL, ""))


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
def deployment_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    _wake(memo, namespace, labels.get(LLMSERVICE_LABEL, ""))


@kopf.on.event(API_GROUP, API_VERSION, PLURAL)
def spec_changed(name: str, namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A spec edit (generation ahead of status.observedGeneration) is acted on at once; our own
    status writes do not wake the loop."""
    generation = body.get("metadata", {}).get("generation")
    if generation != (body.get("status") or {}).get("observedGeneration"):
        _wake(memo, *service_key(namespace or "", name))


@kopf.daemon(API_GROUP, API_VERSION, PLURAL, cancellation_timeout=15, backoff=UNEXPECTED_BACKOFF)
async def service_daemon(
    name: str,
    namespace: str | None,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    # kopf passes each index as a keyword named after its function.
    pods_index: kopf.Index[Any, Any] = kwargs["serving_pods"]
    assert namespace is not None  # LLMService is namespaced
    config = _config(memo)
    executor = memo.get("executor")
    if not isinstance(executor, ServiceExecutor):
        executor = memo["executor"] = ServiceExecutor(name, namespace, config.settings)
    key = service_key(namespace, name)
    wake = _wakers(memo).setdefault(key, asyncio.Event())
    try:
        while not stopped:
            wake.clear()
            started = time.monotonic()
            await executor.run_once(body, list(pods_index.get(key, [])))
            spent = time.monotonic() - started
            await _sleep_until(wake, stopped, max(0.05, config.scrape_interval - spent))
    finally:
        if stopped:
            _wakers(memo).pop(key, None)
            executor.forget()
        await executor.close()


async def _sleep_until(wake: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> None:
    waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
