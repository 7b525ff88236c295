"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, controller-manager, scheduler.

(Over 400 lines because starting four components in order, with their PKI, health checks and
cleanup that survives a killed test run, is one sequence; splitting it would scatter it.)

This is what envtest does for Go operators, plus the controllers (so Deployments really get
ReplicaSets and Pods, and the scheduler really binds them). The binaries come from
hack/testbin/build.sh. Every component runs in its own process group with a parent-death
signal, so nothing outlives the process that started it, even after SIGKILL.

Like a kind cluster it comes with storage: a default StorageClass `rankguard-sim-local` and
a local-path provisioner thread in this process (provisioner.py) whose volumes are folders
under `<workdir>/volumes`; the controller-manager's PV controller binds them to their claims.
`ControlPlane.start(storage=False)` leaves both out.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rankguard_sim.kube.certs import Pki, make_pki
from rankguard_sim.kube.testbin import testbin_dir

if TYPE_CHECKING:
    from kubernetes import client

    from rankguard_sim.kube.provisioner import LocalProvisioner

K8S_VERSION = "v1.34.4"
READY_TIMEOUT = 120.0  # a warm start takes a few seconds; a loaded 2-core CI box needs more
_PR_SET_PDEATHSIG = 1


class ControlPlaneError(RuntimeError):
    """The control plane failed to start; the message says which component and why."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_ports(n: int, avoid: Collection[int] = ()) -> list[int]:
    """`n` distinct free loopback ports, none in `avoid`. The sockets stay bound until all are
    drawn: the kernel may hand a just-closed port out again, so two free_port() calls in a row
    can return the same port (seen: an operator's liveness and metrics ports, one bind refused)."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        while len(ports) < n:
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports


def free_port() -> int:
    return free_ports(1)[0]


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: dict[str, str] | None = None) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, no locks or threads
                env=env,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        # Anything the component forked into its group goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass
class ControlPlane:
    """Start with `ControlPlane.start(workdir)`; stop with `.stop()` (or use as a context manager)."""

    workdir: Path
    bin: Path
    pki: Pki
    apiserver_port: int
    kubeconfig: Path
    logs: Path
    components: list[Component] = field(default_factory=list)
    owns_workdir: bool = False
    provisioner: LocalProvisioner | None = None
    # Where the API server writes its audit log (one JSON line per request, Metadata level), so
    # a benchmark can count the requests of one client; None = no audit log.
    audit_log: Path | None = None

    @property
    def volumes_dir(self) -> Path:
        """Where the sandbox's provisioner keeps the folders of its PersistentVolumes."""
        return self.workdir / "volumes"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def kubectl_path(self) -> Path:
        return self.bin / "kubectl"

    @property
    def helm_path(self) -> Path:
        return self.bin / "helm"

    # ------------------------------------------------------------------ start
    @classmethod
    def start(
        cls,
        workdir: Path | None = None,
        timeout: float = READY_TIMEOUT,
        apiserver_port: int | None = None,
        *,
        storage: bool = True,
        audit_log: Path | None = None,
    ) -> ControlPlane:
        bindir = testbin_dir()
        owns = workdir is None
        wd = Path(tempfile.mkdtemp(prefix="rankguard-cp-")) if workdir is None else workdir
        wd.mkdir(parents=True, exist_ok=True)
        logs = wd / "logs"
        logs.mkdir(exist_ok=True)
        pki = make_pki(wd / "pki")
        cp = cls(
            workdir=wd,
            bin=bindir,
            pki=pki,
            apiserver_port=apiserver_port or free_port(),
            kubeconfig=wd / "kubeconfig",
            logs=logs,
            owns_workdir=owns,
            audit_log=audit_log,
        )
        try:
            cp._start_all(timeout)
            if storage:
                cp._start_storage()
        except BaseException:
            cp.stop()
            raise
        return cp

    def _start_storage(self) -> None:
        from rankguard_sim.kube.provisioner import LocalProvisioner  # noqa: PLC0415 - it imports the client  # noqa: PLC0415 - it imports the client

        api = self.api_client()
        try:
            self.provisioner = LocalProvisioner(api, self.volumes_dir)
            self.provisioner.start()
        finally:
            api.close()  # the provisioner made its own client from this one's configuration

    def _start_all(self, timeout: float) -> None:
        etcd_port, peer_port = free_ports(2, avoid=(self.apiserver_port,))
        for port in (etcd_port, peer_port, self.apiserver_port):
            if not port_is_free(port):
                raise ControlPlaneError(
                    f"port {port} on 127.0.0.1 is already in use; stop what holds it "
                    f"(`ss -ltnp 'sport = :{port}'`) or start again without fixing the port"
                )
        b, p = self.bin, self.pki
        etcd = Component(
            "etcd",
            [
                str(b / "etcd"),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            self.logs / "etcd.log",
        )
        self._launch(etcd)
        self._wait(etcd, lambda: self._http_ok(f"http://127.0.0.1:{etcd_port}/health"), timeout)

        apiserver = Component(
            "kube-apiserver",
            [
                str(b / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.apiserver_port}",
                f"--tls-cert-file={p.serving_cert}",
                f"--tls-private-key-file={p.serving_key}",
                f"--client-ca-file={p.ca_cert}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={p.sa_pub}",
                f"--service-account-signing-key-file={p.sa_key}",
                # /16: room for thousands of Services (the scale benchmark runs 1,000 LLMServices)
                "--service-cluster-ip-range=10.0.0.0/16",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                "--enable-priority-and-fairness=false",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                "--v=1",
                *self._audit_args(),
            ],
            self.logs / "kube-apiserver.log",
        )
        self._launch(apiserver)
        self._wait(apiserver, lambda: self._api_ok("/readyz"), timeout)
        self._write_kubeconfig()

        kc = str(self.kubeconfig)
        cm_port, sched_port = free_ports(2, avoid=(self.apiserver_port, etcd_port, peer_port))
        cm = Component(
            "kube-controller-manager",
            [
                str(b / "kube-controller-manager"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={cm_port}",
                "--leader-elect=false",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={p.sa_key}",
                f"--root-ca-file={p.ca_cert}",
                f"--cert-dir={self.workdir / 'cm-certs'}",
                # Quick node health so a test's Node becomes schedulable soon after it is Ready.
                "--node-monitor-period=1s",
                "--node-monitor-grace-period=20s",
                # An HPA looks every 2s, not 15s (the HPA test waits on it; with no HPA it costs nothing).
                "--horizontal-pod-autoscaler-sync-period=2s",
                "--v=1",
            ],
            self.logs / "kube-controller-manager.log",
        )
        sched = Component(
            "kube-scheduler",
            [
                str(b / "kube-scheduler"),
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                "--leader-elect=false",
                f"--cert-dir={self.workdir / 'sched-certs'}",
                "--v=1",
            ],
            self.logs / "kube-scheduler.log",
        )
        self._launch(cm)
        self._launch(sched)
        self._wait(cm, lambda: self._http_ok(f"https://127.0.0.1:{cm_port}/healthz", insecure=True), timeout)
        self._wait(
            sched, lambda: self._http_ok(f"https://127.0.0.1:{sched_port}/healthz", insecure=True), timeout
        )
        # Pods in "default" need its ServiceAccount, which the controller-manager creates.
        self._wait(cm, lambda: self._api_ok("/api/v1/namespaces/default/serviceaccounts/default"), timeout)

    def _audit_args(self) -> list[str]:
        if self.audit_log is None:
            return []
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(
            json.dumps({"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "rules": [{"level": "Metadata"}]})
        )
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=batch",
            "--audit-log-batch-max-wait=1s",
            "--audit-log-maxbackup=0",
            # never rotated: a bench counts from an offset into this one file (the default, 100 MB,
            # was reached by N=1,000 Running pods' start-up, and a count read the new file empty)
            "--audit-log-maxsize=1000000",
        ]

    def component(self, name: str) -> Component:
        """One of etcd, kube-apiserver, kube-controller-manager, kube-scheduler (for fault drills:
        `cp.component("etcd").stop()`, then `cp.restart("etcd")`)."""
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; there are {[c.name for c in self.components]}")

    def restart(self, name: str, timeout: float = READY_TIMEOUT) -> None:
        """Start a stopped component again with the same arguments (same ports, same data), and
        wait until the API server answers /readyz again."""
        c = self.component(name)
        if not c.alive():
            c.start()
        deadline = time.monotonic() + timeout
        while not self._api_ok("/readyz"):
            if not c.alive():
                raise ControlPlaneError(f"{c.name} exited on restart (see {c.log}):\n{c.log_tail()}")
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"the API server was not ready {timeout:.0f}s after {name} restarted")
            time.sleep(0.2)

    def _launch(self, c: Component) -> None:
        self.components.append(c)
        c.start()

    def _wait(self, c: Component, ready: object, timeout: float) -> None:
        assert callable(ready)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not c.alive():
                raise ControlPlaneError(
                    f"{c.name} exited during start-up (see {c.log}). Last lines:\n{c.log_tail()}"
                )
            if ready():
                return
            time.sleep(0.2)
        raise ControlPlaneError(f"{c.name} was not ready after {timeout:.0f}s (see {c.log}):\n{c.log_tail()}")

    # ----------------------------------------------------------------- probes
    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return ctx

    def _api_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.server + path, context=self._ssl(), timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    @staticmethod
    def _http_ok(url: str, insecure: bool = False) -> bool:
        ctx = None
        if insecure:
            ctx = ssl.create_default_context()
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _write_kubeconfig(self) -> None:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rankguard",
                    "cluster": {"server": self.server, "certificate-authority": str(self.pki.ca_cert)},
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {
                        "client-certificate": str(self.pki.admin_cert),
                        "client-key": str(self.pki.admin_key),
                    },
                }
            ],
            "contexts": [{"name": "rankguard", "context": {"cluster": "rankguard", "user": "admin"}}],
            "current-context": "rankguard",
        }
        self.kubeconfig.write_text(json.dumps(cfg, indent=2))
        self.kubeconfig.chmod(0o600)

    def token_kubeconfig(self, token: str, path: Path) -> Path:
        """A kubeconfig that authenticates with a bearer token (e.g. a ServiceAccount's)."""
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "rankguard",
                    "cluster": {"server": self.server, "certificate-authority": str(self.pki.ca_cert)},
                }
            ],
            "users": [{"name": "token", "user": {"token": token}}],
            "contexts": [{"name": "rankguard", "context": {"cluster": "rankguard", "user": "token"}}],
            "current-context": "rankguard",
        }
        path.write_text(json.dumps(cfg, indent=2))
        path.chmod(0o600)
        return path

    # ------------------------------------------------------------------- use
    def env(self) -> dict[str, str]:
        """An environment for child processes (kubectl, helm, the operator) aimed at this cluster."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
        return r

    def helm(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [str(self.helm_path), f"--kubeconfig={self.kubeconfig}", *args],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
        )
        if check and r.returncode != 0:
            raise subprocess.CalledProcessError(r.returncode, r.args, r.stdout, r.stderr)
        return r

    def api_client(self) -> client.ApiClient:
        """A kubernetes.client.ApiClient for this cluster, from its admin kubeconfig."""
        from kubernetes import config  # noqa: PLC0415 - only needed by callers that ask

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.components if c.proc is not None and c.proc.poll() is None]

    # ------------------------------------------------------------------ stop
    def stop(self) -> None:
        if self.provisioner is not None:
            self.provisioner.stop()
        for c in reversed(self.components):
            c.stop()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(workdir: Path | None = None) -> Iterator[ControlPlane]:
    cp = ControlPlane.start(workdir)
    try:
        yield cp
    finally:
        cp.stop()
