"""The world of bench/operator_scale.py, per N: a fresh local control plane with an API audit log
(Metadata level), the CRD, the bench namespace, and the operator as in its container
(`python -m rankguard_operator`, a subprocess) under the chart's own ServiceAccount and
cluster-wide RBAC (`helm template`, a TokenRequest token), so that its requests are told apart
in the audit log by `user.username`. Removed at the end, whatever happened (unless kept).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from rankguard_sim.kube.cluster import K8S_VERSION, ControlPlane
from rankguard_sim.world import OperatorProcess, create_namespace, install_crd

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
