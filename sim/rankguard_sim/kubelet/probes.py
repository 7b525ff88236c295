"""Container probes as the kubelet runs them: when one is due, and when its result flips.

`ProbeTimer` is pure: the first check after initialDelaySeconds, then every periodSeconds;
the result changes only after failureThreshold consecutive failures or successThreshold
consecutive successes. Readiness and startup start out failing, liveness succeeding, as in
the kubelet's prober. `check_http` / `check_tcp` are the I/O: an HTTP GET whose status is
200-399 succeeds (redirects are not followed, a redirect status counts as success), a TCP
connect that completes succeeds.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rankguard_sim.kubelet.pod.spec import Container, SpecError, named_port


@dataclass(frozen=True)
class ProbeSpec:
    kind: str  # "httpGet" | "tcpSocket" | "exec" | "grpc"
    initial_delay: float = 0.0
    period: float = 10.0
    timeout: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3
    host: str = ""
    port: int = 0
    path: str = "/"
    scheme: str = "HTTP"
    headers: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] = ()


def parse_probe(probe: Mapping[str, Any], container: Container) -> ProbeSpec:
    """A probe from the pod spec, with the API's defaults (period 10 s, timeout 1 s, 1/3)."""
    common: dict[str, Any] = {
        "initial_delay": float(probe.get("initialDelaySeconds") or 0),
        "period": float(probe.get("periodSeconds") or 10),
        "timeout": float(probe.get("timeoutSeconds") or 1),
        "success_threshold": int(probe.get("successThreshold") or 1),
        "failure_threshold": int(probe.get("failureThreshold") or 3),
    }
    if "httpGet" in probe:
        h = probe["httpGet"]
        return ProbeSpec(
            kind="httpGet",
            host=str(h.get("host") or ""),
            port=named_port(container, h.get("port")),
            path=str(h.get("path") or "/"),
            scheme=str(h.get("scheme") or "HTTP").upper(),
            headers=tuple((str(x["name"]), str(x["value"])) for x in h.get("httpHeaders") or []),
            **common,
        )
    if "tcpSocket" in probe:
        t = probe["tcpSocket"]
        return ProbeSpec(
            kind="tcpSocket",
            host=str(t.get("host") or ""),
            port=named_port(container, t.get("port")),
            **common,
        )
    if "exec" in probe:
        return ProbeSpec(
            kind="exec", command=tuple(str(c) for c in probe["exec"].get("command") or []), **common
        )
    if "grpc" in probe:
        return ProbeSpec(kind="grpc", port=int(probe["grpc"].get("port", 0)), **common)
    raise SpecError("ProbeError", f"probe has no handler: {sorted(probe)}")


class ProbeTimer:
    """When a probe is due and what its current result is (no I/O)."""

    def __init__(self, spec: ProbeSpec, started_at: float, initial: bool) -> None:
        self.spec = spec
        self.result = initial
        self.next_at = started_at + spec.initial_delay
        self._streak_ok = 0
        self._streak_fail = 0
        self.last_message = ""

    @property
    def failed_out(self) -> bool:
        """failureThreshold consecutive failures: a startup probe that gives up kills the container."""
        return self._streak_fail >= self.spec.failure_threshold

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float, message: str = "") -> bool:
        """Count one check; returns True when the result flipped."""
        self.next_at = now + self.spec.period
        self.last_message = message
        if ok:
            self._streak_ok += 1
            self._streak_fail = 0
            flip = not self.result and self._streak_ok >= self.spec.success_threshold
        else:
            self._streak_fail += 1
            self._streak_ok = 0
            flip = self.result and self._streak_fail >= self.spec.failure_threshold
        if flip:
            self.result = ok
        return flip


def check_http(spec: ProbeSpec, pod_ip: str) -> tuple[bool, str]:
    host = spec.host or pod_ip
    conn: http.client.HTTPConnection
    if spec.scheme == "HTTPS":
        # The kubelet does not verify serving certificates of probes.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        conn = http.client.HTTPSConnection(host, spec.port, timeout=spec.timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, spec.port, timeout=spec.timeout)
    try:
        headers = {"User-Agent": "kube-probe/1.34", "Accept": "*/*", **dict(spec.headers)}
        conn.request("GET", spec.path, headers=headers)
        status = conn.getresponse().status
    except (OSError, http.client.HTTPException) as e:
        return False, f'Get "{spec.scheme.lower()}://{host}:{spec.port}{spec.path}": {e}'
    finally:
        conn.close()
    if 200 <= status < 400:
        return True, ""
    return False, f"HTTP probe failed with statuscode: {status}"


def check_tcp(spec: ProbeSpec, pod_ip: str) -> tuple[bool, str]:
    host = spec.host or pod_ip
    try:
        with socket.create_connection((host, spec.port), timeout=spec.timeout):
            return True, ""
    except OSError as e:
        return False, f"dial tcp {host}:{spec.port}: {e}"
