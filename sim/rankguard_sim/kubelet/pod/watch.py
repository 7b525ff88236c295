"""The process kubelet's watch on the pods bound to its node.

List, then watch from that resourceVersion (bookmarks keep it fresh); a watch that expires
(410) or drops is followed by a new list, so no event is lost for long. What to do with the
pods is the kubelet's: it gets the full list after every relist, then each event.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from rankguard_sim.kube.api import Throttled, raw_call
from rankguard_sim.kubelet.pod.meta import meta_of

Pod = dict[str, Any]


class PodWatch:
    """`run()` (a thread's target) lists and watches until `stopping` is set."""

    def __init__(
        self,
        api_client: client.ApiClient,
        node_name: str,
        stopping: threading.Event,
        throttle: Throttled,
        *,
        on_list: Callable[[list[Pod]], None],
        on_upsert: Callable[[Pod], None],
        on_gone: Callable[[Pod], None],
    ) -> None:
        self._api_client = api_client
        self.node_name = node_name
        self._stopping = stopping
        self._throttle = throttle
        self._on_list = on_list
        self._on_upsert = on_upsert
        self._on_gone = on_gone
        self._lock = threading.Lock()
        self._resp: Any = None

    @property
    def resp(self) -> Any:
        """The watch's open response, if one is open (tests cut it to simulate a drop)."""
        with self._lock:
            return self._resp

    def interrupt(self) -> None:
        """Cut the open watch so that `run()` sees `stopping` at once."""
        resp = self.resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()

    def run(self) -> None:
        core = client.CoreV1Api(self._api_client)
        selector = f"spec.nodeName={self.node_name}"
        rv: str | None = None
        delay = 0.2
        while not self._stopping.is_set():
            try:
                if rv is None:
                    rv = self.relist(core, selector)
                rv = self.watch_once(core, selector, rv)
                delay = 0.2
            except Exception as e:
                if self._stopping.is_set():
                    break
                self._throttle.warn("node %s: pod watch failed (%s); re-listing", self.node_name, e)
                rv = None
                self._stopping.wait(delay)
                delay = min(delay * 2, 5.0)

    def relist(self, core: client.CoreV1Api, selector: str) -> str:
        doc = raw_call(core.list_pod_for_all_namespaces, field_selector=selector)
        self._on_list(list(doc.get("items") or []))
        return str((doc.get("metadata") or {}).get("resourceVersion", ""))

    def watch_once(self, core: client.CoreV1Api, selector: str, rv: str) -> str | None:
        """Follow one watch to its end; the last resourceVersion, or None to relist (410)."""
        resp = core.list_pod_for_all_namespaces(
            field_selector=selector,
            watch=True,
            resource_version=rv,
            allow_watch_bookmarks=True,
            timeout_seconds=300,
            _preload_content=False,
        )
        with self._lock:
            self._resp = resp
        if self._stopping.is_set():  # interrupt() may have looked for the response before it existed
            resp.release_conn()
            return rv
        try:
            for line in iter_resp_lines(resp):
                if self._stopping.is_set():
                    break
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        return None  # too old: relist
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                rv = str(meta_of(obj).get("resourceVersion") or rv)
                if kind == "DELETED":
                    self._on_gone(obj)
                elif kind in ("ADDED", "MODIFIED"):
                    self._on_upsert(obj)
        finally:
            with self._lock:
                self._resp = None
            with contextlib.suppress(Exception):
                # A watch left mid-stream must not go back to the pool with unread events.
                resp.close()
            with contextlib.suppress(Exception):
                resp.release_conn()
        return rv
