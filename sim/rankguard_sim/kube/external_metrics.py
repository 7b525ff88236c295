"""A small External metrics API (external.metrics.k8s.io/v1beta1) for the sandbox's control plane.

What prometheus-adapter is to a real cluster: an aggregated API the HPA controller asks, through
the kube-apiserver, for an External metric's value. Here a test sets the values itself
(`.values.set_value`), as the adapter would serve a Prometheus recording rule such as
`rankguard:llmservice_demand_replicas`, so the real HPA controller in the sandbox's
kube-controller-manager can scale on it.

How the API server reaches a process on loopback, the honest way (tried, against v1.34's):
- **The Service is an ExternalName** pointing at `localhost`. The aggregator resolves an
  APIService's Service to its ClusterIP, which nothing routes to here; an ExternalName Service it
  resolves to the name itself, dialled at the APIService's port. (Endpoints refuse loopback
  addresses, so `--enable-aggregator-routing`, which dials an endpoint, would not help.)
- **TLS is checked** as the aggregator always checks it: the serving certificate is self-signed
  (certs.make_self_signed) with the name `<service>.<namespace>.svc`, the server name the
  aggregator expects, and it is the APIService's caBundle.
- **No client authentication.** The aggregator's proxy identifies the user in headers; a real
  adapter would verify its client certificate and ask for authorization. This one serves anyone
  on loopback: it only answers numbers a test chose. So the API server needs no aggregator flags
  (without `--proxy-client-cert-file` it proxies with no client certificate).
- **Discovery** (`/apis/external.metrics.k8s.io/v1beta1`) answers 200, which is what the
  aggregator's availability check asks of a backend; OpenAPI (v2 and v3) is an empty document,
  as the aggregator downloads both to merge and logs an error every retry on a 404.

`ExternalMetricsApi.start(cp)` serves and registers, then waits until the APIService is Available;
`.stop()` unregisters first: an APIService left unavailable would break discovery for everyone
else (the namespace controller would stop deleting namespaces).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rankguard_sim.kube.certs import make_self_signed
from rankguard_sim.kube.cluster import ControlPlane, free_port

if TYPE_CHECKING:
    from kubernetes import client

GROUP, VERSION = "external.metrics.k8s.io", "v1beta1"
GROUP_VERSION = f"{GROUP}/{VERSION}"
API_SERVICE = f"{VERSION}.{GROUP}"
SERVICE, SERVICE_NAMESPACE = "rankguard-sim-external-metrics", "kube-system"
READY_TIMEOUT = 120.0
# A selector term as Kubernetes prints one: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a)`,
# `k` (exists) or `!k` (does not).
_TERM = re.compile(r"^(!?)([^\s!=,()]+)\s*(?:(==|=|!=)\s*([^\s,()]*)|\s+(in|notin)\s+\(([^)]*)\))?$")


class SelectorError(ValueError):
    """A labelSelector this server cannot read (answered 400, as the API server would)."""


def _terms(selector: str) -> list[str]:
    """Split at the commas that are not inside `in (…)`."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return [t.strip() for t in terms if t.strip()]


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Whether `labels` satisfy a label selector in its string form (what the HPA controller
    sends as `labelSelector`, from the metric's `selector`)."""
    for term in _terms(selector):
        m = _TERM.match(term)
        if m is None:
            raise SelectorError(f"cannot read selector term {term!r}")
        negate, key, op, value, set_op, values = m.groups()
        have = labels.get(key)
        if op is not None:
            ok = have == value if op in {"=", "=="} else have != value
        elif set_op is not None:
            members = {v.strip() for v in values.split(",")}
            ok = have in members if set_op == "in" else have not in members
        else:
            ok = (have is None) if negate else (have is not None)
        if not ok:
            return False
    return True


def quantity(value: float) -> str:
    """A resource.Quantity string: whole numbers as they are, others in thousandths ("1500m")."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(value * 1000)}m"


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Asked:
    """One request for values, as it reached this server through the API server."""

    namespace: str
    metric: str
    label_selector: str


class Values:
    """The series this API serves, as a test sets them, and what it was asked (thread-safe: the
    server answers from its own thread while a test sets values from another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], list[Series]] = {}
        self._asked: list[Asked] = []

    def set_value(
        self, namespace: str, metric: str, value: float, labels: dict[str, str] | None = None
    ) -> None:
        """Serve `value` for `metric` in `namespace` with these labels (one series per label set)."""
        labels = dict(labels or {})
        with self._lock:
            kept = [s for s in self._series.get((namespace, metric), []) if s.labels != labels]
            self._series[(namespace, metric)] = [*kept, Series(labels, value)]

    def asked_for(self, namespace: str, metric: str) -> list[Asked]:
        with self._lock:
            return [a for a in self._asked if a.namespace == namespace and a.metric == metric]

    def metric_names(self) -> list[str]:
        with self._lock:
            return sorted({metric for _, metric in self._series})

    def answer(self, namespace: str, metric: str, selector: str) -> list[Series]:
        """The series of `metric` in `namespace` that `selector` chooses; the request is recorded."""
        with self._lock:
            self._asked.append(Asked(namespace, metric, selector))
            series = list(self._series.get((namespace, metric), []))
        return [s for s in series if selector_matches(selector, s.labels)]


def metrics_app(values: Values) -> web.Application:
    """The API's routes: discovery, OpenAPI, and the values of one metric in one namespace."""
    version = {"groupVersion": GROUP_VERSION, "version": VERSION}
    group = {"name": GROUP, "versions": [version], "preferredVersion": version}

    async def group_list(request: web.Request) -> web.Response:
        return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group]})

    async def api_group(request: web.Request) -> web.Response:
        return web.json_response({"kind": "APIGroup", "apiVersion": "v1", **group})

    async def resources(request: web.Request) -> web.Response:
        # As prometheus-adapter lists them: one resource per metric it can serve.
        found = [
            {
                "name": n,
                "singularName": "",
                "namespaced": True,
                "kind": "ExternalMetricValueList",
                "verbs": ["get"],
            }
            for n in values.metric_names()
        ]
        return web.json_response(
            {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUP_VERSION, "resources": found}
        )

    async def openapi(request: web.Request) -> web.Response:
        if request.path.startswith("/openapi/v3"):
            return web.json_response({"paths": {}})
        return web.json_response(
            {"swagger": "2.0", "info": {"title": SERVICE, "version": VERSION}, "paths": {}}
        )

    async def metric_values(request: web.Request) -> web.Response:
        ns, metric = request.match_info["namespace"], request.match_info["metric"]
        try:
            chosen = values.answer(ns, metric, request.query.get("labelSelector", ""))
        except SelectorError as e:
            return web.json_response(_status(400, "BadRequest", str(e)), status=400)
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        items = [
            {"metricName": metric, "metricLabels": s.labels, "timestamp": stamp, "value": quantity(s.value)}
            for s in chosen
        ]
        return web.json_response(
            {"kind": "ExternalMetricValueList", "apiVersion": GROUP_VERSION, "metadata": {}, "items": items}
        )

    app = web.Application()
    app.router.add_get("/openapi/v2", openapi)
    app.router.add_get("/openapi/v3", openapi)
    app.router.add_get("/apis", group_list)
    app.router.add_get(f"/apis/{GROUP}", api_group)
    app.router.add_get(f"/apis/{GROUP_VERSION}", resources)
    app.router.add_get(f"/apis/{GROUP_VERSION}/namespaces/{{namespace}}/{{metric}}", metric_values)
    return app


@dataclass
class ExternalMetricsApi:
    """Start with `ExternalMetricsApi.start(cp)`; stop with `.stop()` (or use as a context manager).
    Set what it serves with `.values.set_value(...)`."""

    cp: ControlPlane
    port: int
    cert: Path
    key: Path
    values: Values = field(default_factory=Values)
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None

    async def _serve(self) -> None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(str(self.cert), str(self.key))
        self._runner = web.AppRunner(metrics_app(self.values), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=tls).start()

    # ------------------------------------------------------------------ start / stop
    @classmethod
    def start(cls, cp: ControlPlane, timeout: float = READY_TIMEOUT) -> ExternalMetricsApi:
        cert, key = make_self_signed(
            cp.workdir / "external-metrics-certs",
            SERVICE,
            dns_names=(f"{SERVICE}.{SERVICE_NAMESPACE}.svc",),
        )
        server = cls(cp=cp, port=free_port(), cert=cert, key=key)
        server._thread = threading.Thread(
            target=server._loop.run_forever, name="external-metrics", daemon=True
        )
        server._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(server._serve(), server._loop).result(30)
            server._register(timeout)
        except BaseException:
            server.stop()
            raise
        return server

    def _register(self, timeout: float) -> None:
        from kubernetes import client  # noqa: PLC0415 - only a started server needs the client

        api = self.cp.api_client()
        try:
            client.CoreV1Api(api).create_namespaced_service(
                SERVICE_NAMESPACE,
                {
                    "metadata": {"name": SERVICE},
                    # the aggregator dials an ExternalName service's name at the APIService's port
                    "spec": {"type": "ExternalName", "externalName": "localhost"},
                },
            )
            client.ApiregistrationV1Api(api).create_api_service(
                {
                    "metadata": {"name": API_SERVICE},
                    "spec": {
                        "group": GROUP,
                        "version": VERSION,
                        "service": {"namespace": SERVICE_NAMESPACE, "name": SERVICE, "port": self.port},
                        "caBundle": base64.b64encode(self.cert.read_bytes()).decode(),
                        "groupPriorityMinimum": 100,
                        "versionPriority": 100,
                    },
                }
            )
            self._wait_available(api, timeout)
        finally:
            api.close()

    @staticmethod
    def _available(api: client.ApiClient) -> tuple[bool, str]:
        from kubernetes import client  # noqa: PLC0415

        svc = client.ApiregistrationV1Api(api).read_api_service(API_SERVICE)
        for c in (svc.status.conditions if svc.status else None) or []:
            if c.type == "Available":
                return c.status == "True", f"{c.reason}: {c.message}"
        return False, "no Available condition yet"

    def _wait_available(self, api: client.ApiClient, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ok, why = self._available(api)
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"APIService {API_SERVICE} not Available after {timeout:.0f}s: {why}")
            time.sleep(0.2)

    def _unregister(self) -> None:
        from kubernetes import client  # noqa: PLC0415
        from kubernetes.client.rest import ApiException  # noqa: PLC0415

        api = self.cp.api_client()
        try:
            with contextlib.suppress(ApiException):
                client.ApiregistrationV1Api(api).delete_api_service(API_SERVICE)
            with contextlib.suppress(ApiException):
                client.CoreV1Api(api).delete_namespaced_service(SERVICE, SERVICE_NAMESPACE)
        finally:
            api.close()

    def stop(self) -> None:
        self._unregister()
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        if self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> ExternalMetricsApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }
