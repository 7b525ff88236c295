"""The operator's writes and reads against the API server (the I/O edge, nothing decided here).

The kubernetes client is synchronous; every call runs in a worker thread so the kopf event
loop never blocks. Writes use server-side apply with the field manager `rankguard`, so the
operator owns exactly the fields it renders and a person's edits to other fields survive.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.rest import ApiException

FIELD_MANAGER = "rankguard"
GROUP, VERSION, PLURAL = "rankguard.io", "v1alpha1", "llmservices"
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


def _temporary(e: ApiException, what: str) -> kopf.TemporaryError:
    # 409 (conflict), 429 and 5xx heal by themselves; everything goes back through kopf's back-off.
    return kopf.TemporaryError(
        f"{what}: HTTP {e.status} {e.reason}", delay=2 if e.status in (409, 429) else 5
    )


async def apply(obj: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply a Deployment or Service we render. Returns the object as stored."""
    kind, meta = obj["kind"], obj["metadata"]

    def call() -> Any:
        if kind == "Deployment":
            return client.AppsV1Api(api()).patch_namespaced_deployment(
                meta["name"],
                meta["namespace"],
                dict(obj),
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=_APPLY,
            )
        if kind == "Service":
            return client.CoreV1Api(api()).patch_namespaced_service(
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
            raise kopf.PermanentError(
                f"applying {kind} {meta['name']} was refused: {e.status} {e.body}"
            ) from e
        raise _temporary(e, f"applying {kind} {meta['name']}") from e
    return dict(api().sanitize_for_serialization(result))


async def get_deployment(namespace: str, name: str) -> dict[str, Any] | None:
    def call() -> Any:
        return client.AppsV1Api(api()).read_namespaced_deployment(name, namespace)

    try:
        d = await asyncio.to_thread(call)
    except ApiException as e:
        if e.status == 404:
            return None
        raise _temporary(e, f"reading Deployment {name}") from e
    return dict(api().sanitize_for_serialization(d))


async def get_service(namespace: str, name: str) -> dict[str, Any] | None:
    def call() -> Any:
        return client.CustomObjectsApi(api()).get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name
        )

    try:
        return dict(await asyncio.to_thread(call))
    except ApiException as e:
        if e.status == 404:
            return None
        raise _temporary(e, f"reading LLMService {name}") from e


async def patch_status(namespace: str, name: str, status_patch: Mapping[str, Any]) -> None:
    """JSON-merge-patch .status (only the keys given; a None value deletes a key)."""

    def call() -> Any:
        return client.CustomObjectsApi(api()).patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status_patch)}, _content_type=_MERGE
        )

    try:
        await asyncio.to_thread(call)
    except ApiException as e:
        if e.status == 404:
            return  # deleted meanwhile: nothing to report on
        raise _temporary(e, f"writing status of LLMService {name}") from e
