"""The Kubernetes objects the tests write again and again, built in one place (as
kubernetes-sigs/lws's test/wrappers do): an LLMService, a controller's ownerReference, and an
object that names its owner. Each returns a fresh plain dict shaped as the API serves it, with
only the fields a test gives; a test adds what its case is about by hand, where the reader sees it.
"""

from __future__ import annotations

from typing import Any

API_VERSION = "rankguard.io/v1alpha1"


def llmservice(name: str, spec: dict[str, Any], *, namespace: str | None = None) -> dict[str, Any]:
    """An LLMService named `name` (in `namespace` where given) with `spec` itself (not a copy)."""
    metadata: dict[str, Any] = {"name": name}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": "LLMService", "metadata": metadata, "spec": spec}


def owner_ref(
    kind: str,
    uid: str,
    *,
    name: str | None = None,
    api_version: str | None = None,
    controller: bool = True,
    block_owner_deletion: bool | None = None,
) -> dict[str, Any]:
    """An ownerReference to a `kind` of `uid`: its controller's unless `controller=False`; its name,
    apiVersion and blockOwnerDeletion only where given (the pure code reads kind, uid and
    controller; the API server wants apiVersion and name too)."""
    ref: dict[str, Any] = {} if api_version is None else {"apiVersion": api_version}
    ref["kind"] = kind
    if name is not None:
        ref["name"] = name
    ref.update(uid=uid, controller=controller)
    if block_owner_deletion is not None:
        ref["blockOwnerDeletion"] = block_owner_deletion
    return ref


def owned(name: str, uid: str, *owners: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """An object named `name` of `uid` that lists `owners` as its ownerReferences (none: an empty
    list), with the other top-level `fields` (spec=..., status=...) as given."""
    return {"metadata": {"name": name, "uid": uid, "ownerReferences": list(owners)}, **fields}
