"""The world of bench/operator_scale.py, per N: a fresh local control plane with an API audit log
(Metadata level), the CRD, the bench namespace, and the operator as in its container
(`python -m rankguard_operator`, a subprocess) under the chart's own ServiceAccount and
cluster-wide RBAC (`helm template`, a TokenRequest token), so that its requests are told apart
in the audit log by `user.username`. Removed at the end, whatever happened (unless kept).

And what the bench reads of the operator there: its requests in the audit log (`audit_count`)
and its process's CPU and memory in /proc (`proc_sample`, the agents' processes too).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from rankguard_sim.kube.cluster import K8S_VERSION, ControlPlane
from rankguard_sim.world import OperatorProcess, create_namespace, install_crd
from scale_measure import count_requests, cpu_ticks, memory_bytes, parse_audit_line

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "rankguard"
OPERATOR_NS, BENCH_NS = "rankguard-system", "bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Sandbox:
    cp: ControlPlane
    api: Any
    op: OperatorProcess
    username: str  # the operator's user in the audit log
    audit_log: Path


def operator_identity(cp: ControlPlane, api: Any, workdir: Path) -> tuple[Path, str]:
    """The chart's ServiceAccount and cluster-wide RBAC, and a kubeconfig with its token."""
    create_namespace(api, OPERATOR_NS)
    rendered = cp.helm(
        "template", "rankguard", str(CHART), "-n", OPERATOR_NS, f"--kube-version={K8S_VERSION}",
        "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml",
    ).stdout  # fmt: skip
    cp.kubectl("apply", "-n", OPERATOR_NS, "-f", "-", input=rendered)
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    account = next(d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount")
    if not any(d["kind"] == "ClusterRoleBinding" for d in docs):
        raise RuntimeError("the chart rendered no ClusterRoleBinding for a cluster-wide install")
    # TokenRequest, as the kubelet projects into the chart's pod; long enough for N=1,000.
    tr = client.CoreV1Api(api).create_namespaced_service_account_token(
        account, OPERATOR_NS, {"spec": {"expirationSeconds": 86400}}
    )
    kubeconfig = cp.token_kubeconfig(tr.status.token, workdir / "operator.kubeconfig")
    return kubeconfig, f"system:serviceaccount:{OPERATOR_NS}:{account}"


@contextmanager
def sandbox(operator_env: dict[str, str], keep: bool, metrics: bool = False) -> Iterator[Sandbox]:
    """A control plane with an audit log, the CRD, the bench namespace, and the operator."""
    workdir = Path(tempfile.mkdtemp(prefix="rankguard-scale-"))
    audit = workdir / "audit.log"
    cp = ControlPlane.start(workdir / "cp", audit_log=audit)
    api: Any = None
    op: OperatorProcess | None = None
    try:
        install_crd(cp)
        api = cp.api_client()
        kubeconfig, username = operator_identity(cp, api, workdir)
        create_namespace(api, BENCH_NS)
        env = {"RANKGUARD_WATCH_NAMESPACES": BENCH_NS, **operator_env}
        op = OperatorProcess(kubeconfig, workdir / "operator.log", env_extra=env, metrics=metrics)
        op.start()
        op.wait_ready()
        yield Sandbox(cp, api, op, username, audit)
    finally:
        if op is not None:
            op.stop()
        if api is not None:
            api.close()
        cp.stop()
        if keep:
            log(f"kept {workdir} (audit log, operator log, control-plane logs)")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def audit_written_past(path: Path, end: float) -> bool:
    """Whether the audit log already holds a request received at `end` or later (any client's)."""
    start = max(0, path.stat().st_size - 65536)
    with path.open("rb") as f:
        f.seek(start)
        lines = f.read().splitlines()[1 if start else 0 :]  # past 0, the first line may be cut
    last = next((ev for ev in map(parse_audit_line, reversed(lines)) if ev is not None), None)
    return last is not None and last.received >= end


def audit_count(box: Sandbox, offset: int, start: float, end: float) -> Counter[str]:
    """The operator's requests received in [start, end) (wall clock), read from `offset` on,
    once the log has caught up past `end`: batch mode flushes every second, but behind a burst
    (a thousand pods started) it ran minutes late, and a count after a fixed wait read nothing."""
    deadline = time.monotonic() + 300
    while not audit_written_past(box.audit_log, end) and time.monotonic() < deadline:
        client.VersionApi(box.api).get_code()  # a request of our own, for the log to show
        time.sleep(1.0)
    with box.audit_log.open("rb") as f:
        f.seek(offset)
        return count_requests(f, box.username, start, end)


def proc_sample(pid: int) -> tuple[int, dict[str, int]]:
    """A process's CPU ticks so far (every thread) and its memory lines (VmRSS, VmHWM, ...)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    status = Path(f"/proc/{pid}/status").read_text()
    return cpu_ticks(stat), memory_bytes(status)
