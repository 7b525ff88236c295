"""The process kubelet's API calls on behalf of its pods: status, deletion, volume sources
(configMaps, secrets, service-account tokens, persistent volume claims and their volumes).

Plain dicts in and out (`raw_call`), as everywhere in the sandbox; API trouble is logged
through `Throttled`, one line per distinct message per interval.
"""

from __future__ import annotations

import base64
import datetime
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_sim.kube.api import Throttled, raw_call
from rankguard_sim.kubelet.pod.meta import meta_of, pod_key, spec_of

log = logging.getLogger("rankguard_sim.kubelet")


class PodApi:
    """What a pod worker asks of the API server, over the kubelet's client."""

    def __init__(self, core: client.CoreV1Api, throttle: Throttled, stopping: threading.Event) -> None:
        self.core = core
        self._throttle = throttle
        self._stopping = stopping  # the kubelet is stopping: retries end

    def patch_status(self, namespace: str, name: str, uid: str, status: dict[str, Any]) -> None:
        # A JSON merge patch replaces the status lists whole: the kubelet owns them. The uid
        # is a precondition, as in the kubelet's own patch: a pod re-created under the same
        # name must not get the old one's status.
        # raw_call reads the body before the connection goes back to the pool: a connection
        # returned with an unread body hands the next request that body as its status line.
        raw_call(
            self.core.patch_namespaced_pod_status,
            name,
            namespace,
            {"metadata": {"uid": uid}, "status": status},
            _content_type="application/merge-patch+json",
        )

    def pod_exists(self, namespace: str, name: str, uid: str) -> bool:
        """Whether the pod (same uid) is still in the API; True when unsure."""
        try:
            doc = raw_call(self.core.read_namespaced_pod, name, namespace)
        except ApiException as e:
            return bool(e.status != 404)
        except Exception:
            return True
        return str(meta_of(doc).get("uid")) == uid

    def confirm_deletion(self, pod: Mapping[str, Any]) -> None:
        meta = meta_of(pod)
        body = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=str(meta.get("uid")))
        )
        for attempt in range(10):
            try:
                raw_call(
                    self.core.delete_namespaced_pod, str(meta["name"]), str(meta["namespace"]), body=body
                )
                return
            except ApiException as e:
                if e.status in (404, 409):
                    return  # gone already, or a new pod took the name
                self._throttle.warn("pod %s: confirming deletion failed (%s)", pod_key(pod), e.status)
            except Exception as e:
                self._throttle.warn("pod %s: confirming deletion failed (%s)", pod_key(pod), e)
            if self._stopping.wait(min(0.2 * 2**attempt, 3.0)):
                return

    def lookup_object(self, kind: str, namespace: str, name: str) -> dict[str, str] | None:
        read = (
            self.core.read_namespaced_config_map if kind == "configmap" else self.core.read_namespaced_secret
        )
        try:
            doc = raw_call(read, name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        data = {str(k): str(v) for k, v in (doc.get("data") or {}).items()}
        if kind == "secret":
            data = {k: base64.b64decode(v).decode("utf-8", errors="replace") for k, v in data.items()}
        return data

    def read_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A PersistentVolumeClaim as a dict, or None when it does not exist."""
        return self._read_or_none(self.core.read_namespaced_persistent_volume_claim, name, namespace)

    def read_volume(self, name: str) -> dict[str, Any] | None:
        """A PersistentVolume as a dict, or None when it does not exist."""
        return self._read_or_none(self.core.read_persistent_volume, name)

    @staticmethod
    def _read_or_none(call: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
        try:
            return raw_call(call, *args)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def pod_events(self, node: str) -> PodEvents:
        """A recorder of one pod's Warning Events, as the kubelet on `node` posts them."""
        return PodEvents(self.core, self._throttle, node)

    def lookup_key(self, kind: str, namespace: str, name: str, key: str) -> str | None:
        data = self.lookup_object(kind, namespace, name)
        return None if data is None else data.get(key)

    def service_account_token(self, pod: Mapping[str, Any], source: Mapping[str, Any]) -> str:
        meta, spec = meta_of(pod), spec_of(pod)
        body: dict[str, Any] = {
            "spec": {
                "expirationSeconds": int(source.get("expirationSeconds") or 3607),
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            }
        }
        if source.get("audience"):
            body["spec"]["audiences"] = [source["audience"]]
        doc = raw_call(
            self.core.create_namespaced_service_account_token,
            str(spec.get("serviceAccountName") or "default"),
            str(meta["namespace"]),
            body,
        )
        return str((doc.get("status") or {}).get("token", ""))


# The kubelet's event recorder folds a repeated Event into one object (count, lastTimestamp);
# the sandbox patches it at most this often, as the recorder's correlator rate-limits.
EVENT_PATCH_SECONDS = 5.0


class PodEvents:
    """The kubelet's Warning Events about one pod (reason FailedMount: the real kubelet says a
    volume it cannot mount only here; the container just waits in ContainerCreating), one Event
    per distinct (reason, message), counted and deduplicated as the kubelet's recorder does."""

    def __init__(self, core: client.CoreV1Api, throttle: Throttled, node: str) -> None:
        self.core, self._throttle, self.node = core, throttle, node
        self._posted: dict[tuple[str, str], tuple[str, int, float]] = {}  # -> (name, count, when)

    def warn(self, pod: Mapping[str, Any], reason: str, message: str, now: float) -> None:
        meta = meta_of(pod)
        key = (reason, message)
        stamp = datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat()
        seen = self._posted.get(key)
        try:
            if seen is None:
                name = f"{meta['name']}.{uuid.uuid4().hex[:16]}"
                body = {
                    "metadata": {"name": name, "namespace": meta["namespace"]},
                    "involvedObject": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "name": meta["name"],
                        "namespace": meta["namespace"],
                        "uid": meta["uid"],
                    },
                    "type": "Warning",
                    "reason": reason,
                    "message": message,
                    "source": {"component": "kubelet", "host": self.node},
                    "reportingComponent": "kubelet",
                    "reportingInstance": self.node,
                    "firstTimestamp": stamp,
                    "lastTimestamp": stamp,
                    "count": 1,
                }
                raw_call(self.core.create_namespaced_event, str(meta["namespace"]), body)
                self._posted[key] = (name, 1, now)
                return
            name, count, when = seen
            if now - when < EVENT_PATCH_SECONDS:
                return
            raw_call(
                self.core.patch_namespaced_event,
                name,
                str(meta["namespace"]),
                {"count": count + 1, "lastTimestamp": stamp},
            )
            self._posted[key] = (name, count + 1, now)
        except ApiException as e:
            self._throttle.warn("pod %s: posting Event %s failed (%s)", pod_key(pod), reason, e.status)
