"""Only one operator acts: leader election on a coordination.k8s.io Lease (core/lease).

kopf's own "peering" is not leader election: operators of the same priority all pause, so it
keeps two replicas from acting by stopping both. Instead, a replica that does not hold the
Lease waits *before* kopf starts (it watches nothing and writes nothing), answering /healthz
so the kubelet keeps it as a standby. Once it holds the Lease, a thread renews it every
RETRY_PERIOD; if it cannot renew for RENEW_DEADLINE (an API outage, a partition, another
replica took it) the process exits at once, before any standby may take over, and the kubelet
restarts it as a standby. A clean shutdown gives the Lease up, so a rolling update hands over
in a couple of seconds rather than a whole lease.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from rankguard_operator.core import lease
from rankguard_operator.edge.metrics import LEADER

log = logging.getLogger("rankguard_operator.leader")


class LeaseClient:
    """The three calls on one Lease; None for "not there", False for "lost the race"."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str) -> None:
        self.api, self.coordination = api, client.CoordinationV1Api(api)
        self.namespace, self.name = namespace, name

    def read(self) -> tuple[dict[str, Any] | None, str | None]:
        """(spec, resourceVersion), (None, None) when the Lease does not exist."""
        try:
            obj = self.coordination.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
        except ApiException as e:
            if e.status == 404:
                return None, None
            raise
        doc = self.api.sanitize_for_serialization(obj)
        return dict(doc.get("spec") or {}), str(doc["metadata"].get("resourceVersion") or "")

    def write(self, spec: Mapping[str, Any], resource_version: str | None) -> bool:
        """Create (no resource version) or replace (only if unchanged since read)."""
        meta = {"name": self.name, "namespace": self.namespace}
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": dict(spec)}
        try:
            if resource_version is None:
                self.coordination.create_namespaced_lease(self.namespace, body, _request_timeout=5)
            else:
                self.coordination.replace_namespaced_lease(
                    self.name, self.namespace, body, _request_timeout=5
                )
        except ApiException as e:
            if e.status == 409:
                return False  # someone wrote it between our read and our write
            raise
        return True


@dataclass(frozen=True)
class Timing:
    lease_seconds: int = lease.LEASE_SECONDS
    renew_deadline: float = lease.RENEW_DEADLINE
    retry_period: float = lease.RETRY_PERIOD


class LeaderElector:
    def __init__(self, leases: LeaseClient, identity: str, timing: Timing = Timing()) -> None:
        self.leases, self.identity, self.timing = leases, identity, timing
        self._observed: lease.Observed | None = None
        self._holder = ""
        self._stop = threading.Event()

    def try_once(self) -> bool:
        """One look at the Lease: True when we hold it afterwards."""
        spec, rv = self.leases.read()
        verdict = lease.decide(
            spec,
            self.identity,
            now=time.monotonic(),
            wall=time.time(),
            observed=self._observed,
            lease_seconds=self.timing.lease_seconds,
        )
        self._observed = verdict.observed
        if verdict.holder != self._holder and verdict.action == "wait":
            log.info("standby: the Lease %s is held by %s", self.leases.name, verdict.holder)
        self._holder = verdict.holder
        if verdict.action == "wait":
            return False
        return self.leases.write(verdict.spec, rv)

    def acquire(self) -> None:
        """Block until we hold the Lease (API errors are retried: a standby has time)."""
        log.info("waiting to lead: Lease %s/%s as %s", self.leases.namespace, self.leases.name, self.identity)
        while True:
            try:
                if self.try_once():
                    break
            except (ApiException, HTTPError, OSError) as e:
                log.debug("Lease not read: %s", e)
            time.sleep(self.timing.retry_period)
        LEADER.set(1)
        log.info("leading: Lease %s/%s held as %s", self.leases.namespace, self.leases.name, self.identity)

    def keep(self, on_lost: Callable[[str], None]) -> threading.Thread:
        """Renew in a thread of its own (never behind a busy event loop); `on_lost` is called
        when a renewal deadline passes or someone else holds the Lease."""

        def renew() -> None:
            last_ok = time.monotonic()
            while not self._stop.wait(self.timing.retry_period):
                try:
                    if self.try_once():
                        last_ok = time.monotonic()
                        continue
                    why = f"the Lease is now held by {self._holder or 'nobody'}"
                except (ApiException, HTTPError, OSError) as e:
                    why = f"renewing failed: {e}"
                if (
                    self._holder not in ("", self.identity)
                    or time.monotonic() - last_ok > self.timing.renew_deadline
                ):
                    LEADER.set(0)
                    on_lost(why)
                    return

        thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """Give the Lease up (a clean shutdown): a standby takes over without waiting a lease."""
        self._stop.set()
        with contextlib.suppress(ApiException, HTTPError, OSError):
            spec, rv = self.leases.read()
            given = lease.released(spec, self.identity, time.time()) if spec is not None else None
            if given is not None and self.leases.write(given, rv):
                log.info("Lease %s released", self.leases.name)
        LEADER.set(0)


def exit_now(why: str) -> None:
    """Lost the Lease: stop acting at once. Anything still in flight would act without it."""
    log.critical("lost leadership (%s): exiting, to restart as a standby", why)
    logging.shutdown()
    os._exit(1)


class StandbyHealth:
    """/healthz answering 200 while a replica waits for the Lease, on the port kopf serves it
    on once leading, so the kubelet keeps a standby alive without restarting it."""

    def __init__(self, host: str, port: int) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if self.path.startswith("/healthz") else 404)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"standby\n")

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a probe every few seconds is not news

        self.server = http.server.ThreadingHTTPServer((host, port), Handler) if port else None
        if self.server is not None:
            threading.Thread(target=self.server.serve_forever, name="standby-health", daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()  # free the port for kopf's own endpoint
