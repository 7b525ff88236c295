"""The operator's writes and reads against the API server (the I/O edge, nothing decided here).

The kubernetes client is synchronous; every call runs in a worker thread so the kopf event
loop never blocks. Writes use server-side apply with the field manager `rankguard`, so the
operator owns exactly the fields it renders and a person's edits to other fields survive.

Error policy, in kopf's terms: trouble that heals by itself (409, 429, 5xx, and the API
server being unreachable) is a `kopf.TemporaryError` with a back-off `delay`, which kopf logs
once per retry, without a traceback; an object the API server refuses (400, 403, 422) is an
`ApplyRefused`, which the executor turns into a condition and an Event on the LLMService.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import kopf
import urllib3
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from rankguard_operator.core.names import API_GROUP, API_VERSION, OWNER_KIND, PLURAL, label_value

log = logging.getLogger("rankguard_operator.k8s")

FIELD_MANAGER = "rankguard"
GROUP, VERSION = API_GROUP, API_VERSION
# Seconds before a retry: conflicts and throttling clear fast; an unreachable or failing API
# server is given longer, so an outage costs one log line per retry, not one per pass.
CONFLICT_DELAY = 2.0
OUTAGE_DELAY = 5.0
_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"

_api: client.ApiClient | None = None


def login() -> None:
    """Load credentials the way kopf does: in-cluster first, then KUBECONFIG."""
    global _api
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # Read KUBECONFIG now: the client's default path was fixed when it was imported.
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    _api = client.ApiClient()


def api() -> client.ApiClient:
    if _api is None:
        login()
    assert _api is not None
    return _api


class ApplyRefused(Exception):
    """The API server refused an object rankguard rendered (400, 403, 422): retrying the same
    object cannot help, the spec (or the operator's permissions) must change."""

    def __init__(self, kind: str, name: str, status: int, detail: str) -> None:
        super().__init__(f"the API server refused {kind} {name} (HTTP {status}): {detail}")
        self.kind, self.name, self.status, self.detail = kind, name, status, detail


def _temporary(e: ApiException, what: str) -> kopf.TemporaryError:
    # 409 (conflict), 429 and 5xx heal by themselves; everything goes back through kopf's back-off.
    delay = CONFLICT_DELAY if e.status in (409, 429) else OUTAGE_DELAY
    return kopf.TemporaryError(f"{what}: HTTP {e.status} {e.reason}", delay=delay)


def _unreachable(e: Exception, what: str) -> kopf.TemporaryError:
    return kopf.TemporaryError(
        f"{what}: the API server is unreachable ({type(e).__name__})", delay=OUTAGE_DELAY
    )


# Connection trouble as the client raises it (urllib3 retries exhausted, resets, timeouts).
_CONNECTION_ERRORS = (urllib3.exceptions.HTTPError, OSError)


def _refusal_detail(e: ApiException) -> str:
    """The API server's own message (a Status object's `message`), else the raw body."""
    try:
        doc = json.loads(e.body or "")
    except (TypeError, ValueError):
        return str(e.body or e.reason)[:1024]
    return str(doc.get("message") or e.reason)[:1024] if isinstance(doc, dict) else str(e.body)[:1024]


# The kinds rankguard renders, and the API call that server-side applies each.
_APPLIERS: dict[str, tuple[Any, str]] = {
    "Deployment": (client.AppsV1Api, "patch_namespaced_deployment"),
    "Service": (client.CoreV1Api, "patch_namespaced_service"),
    "PersistentVolumeClaim": (client.CoreV1Api, "patch_namespaced_persistent_volume_claim"),
}


async def apply(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply a Deployment, Service or PersistentVolumeClaim we render. Returns the
    object as stored."""
    kind, meta = obj["kind"], obj["metadata"]

    def call() -> Any:
        if kind in _APPLIERS:
            group, method = _APPLIERS[kind]
            patch = getattr(group(api()), method)
            return patch(
                meta["name"],
                meta["namespace"],
                dict(obj),
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=_APPLY,
            )
        raise ValueError(f"rankguard does not apply {kind}")

    try:
        result = await asyncio.to_thread(call)
    except ApiException as e:
        if e.status in (400, 403, 422):
            raise ApplyRefused(kind, meta["name"], e.status, _refusal_detail(e)) from e
        raise _temporary(e, f"applying {kind} {meta['name']}") from e
    except _CONNECTION_ERRORS as e:
        raise _unreachable(e, f"applying {kind} {meta['name']}") from e
    return dict(api().sanitize_for_serialization(result))


async def _read(kind: str, name: str, call: Callable[[], Any]) -> dict[str, Any] | None:
    """One object read off the event loop; None when it does not exist."""
    try:
        obj = await asyncio.to_thread(call)
    except ApiException as e:
        if e.status == 404:
            return None
        raise _temporary(e, f"reading {kind} {name}") from e
    except _CONNECTION_ERRORS as e:
        raise _unreachable(e, f"reading {kind} {name}") from e
    return dict(api().sanitize_for_serialization(obj))


async def get_deployment(namespace: str, name: str) -> dict[str, Any] | None:
    return await _read(
        "Deployment", name, lambda: client.AppsV1Api(api()).read_namespaced_deployment(name, namespace)
    )


async def get_configmap(namespace: str, name: str) -> dict[str, Any] | None:
    """A ConfigMap (spec.model.configMap), or None when it does not exist."""
    return await _read(
        "ConfigMap", name, lambda: client.CoreV1Api(api()).read_namespaced_config_map(name, namespace)
    )


async def get_claim(namespace: str, name: str) -> dict[str, Any] | None:
    """A PersistentVolumeClaim (spec.modelCache), or None when it does not exist."""
    return await _read(
        "PersistentVolumeClaim",
        name,
        lambda: client.CoreV1Api(api()).read_namespaced_persistent_volume_claim(name, namespace),
    )


class NodeForbidden(Exception):
    """The operator may not read Nodes (a namespaced install): planning goes on without labels."""


async def get_node(name: str) -> dict[str, Any] | None:
    """A Node (for its labels), or None when it does not exist. Raises NodeForbidden on 403:
    only a cluster-wide install grants `nodes get` (docs/rbac.md)."""

    def call() -> Any:
        return client.CoreV1Api(api()).read_node(name)

    try:
        return await _read("Node", name, call)
    except kopf.TemporaryError as e:
        cause = e.__cause__
        if isinstance(cause, ApiException) and cause.status == 403:
            raise NodeForbidden(_refusal_detail(cause)) from cause
        raise


async def get_llmservice(namespace: str, name: str) -> dict[str, Any] | None:
    return await _read(
        "LLMService",
        name,
        lambda: client.CustomObjectsApi(api()).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        ),
    )


async def patch_status(namespace: str, name: str, status_patch: Mapping[str, Any]) -> str | None:
    """JSON-merge-patch .status (only the keys given; a None value deletes a key). Returns the
    object's resourceVersion after the write (None when the object is gone)."""

    def call() -> Any:
        return client.CustomObjectsApi(api()).patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status_patch)}, _content_type=_MERGE
        )

    try:
        result = await asyncio.to_thread(call)
    except ApiException as e:
        if e.status == 404:
            return None  # deleted meanwhile: nothing to report on
        raise _temporary(e, f"writing status of LLMService {name}") from e
    except _CONNECTION_ERRORS as e:
        raise _unreachable(e, f"writing status of LLMService {name}") from e
    rv = (result.get("metadata") or {}).get("resourceVersion") if isinstance(result, dict) else None
    return rv if isinstance(rv, str) else None


async def post_event(
    service: Mapping[str, Any],
    *,
    type: str,
    reason: str,
    message: str,
    name: str | None = None,
) -> None:
    """Post a core/v1 Event on an LLMService. With `name` the Event is created under a name
    derived from it, so posting the same Event twice (after an operator restart) is a no-op."""
    meta = service.get("metadata") or {}
    namespace, service_name = str(meta.get("namespace") or ""), str(meta.get("name") or "")
    now = datetime.datetime.now(datetime.timezone.utc)
    event_meta: dict[str, Any] = {"namespace": namespace}
    if name:
        event_meta["name"] = f"{label_value(service_name)}.{name}"
    else:
        event_meta["generateName"] = f"{label_value(service_name)}."
    body = {
        "metadata": event_meta,
        "involvedObject": {
            "apiVersion": f"{API_GROUP}/{API_VERSION}",
            "kind": OWNER_KIND,
            "name": service_name,
            "namespace": namespace,
            "uid": meta.get("uid"),
        },
        "type": type,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": FIELD_MANAGER},
        "reportingComponent": FIELD_MANAGER,
        "reportingInstance": FIELD_MANAGER,
        "action": reason,
        "firstTimestamp": now.isoformat(),
        "lastTimestamp": now.isoformat(),
        "count": 1,
    }

    def call() -> Any:
        return client.CoreV1Api(api()).create_namespaced_event(namespace, body)

    try:
        await asyncio.to_thread(call)
    except ApiException as e:
        if e.status == 409 and name:
            return  # posted before (by this operator before a restart): once is enough
        if e.status in (403, 404, 422):
            log.warning(
                "Event %s on LLMService %s/%s not posted: HTTP %s", reason, namespace, service_name, e.status
            )
            return  # an Event is information, never a reason to stop the loop
        raise _temporary(e, f"posting Event {reason}") from e
    except _CONNECTION_ERRORS as e:
        raise _unreachable(e, f"posting Event {reason}") from e
