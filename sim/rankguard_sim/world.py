"""The whole sandbox in one object: control plane, CRD, a simulated GPU node, the operator.

Used by the end-to-end tests and by `make demo`. The operator runs as a real subprocess
(`python -m rankguard_operator`), exactly as in its container; the process kubelet runs in
this process and starts the agent and the fake vLLM as local processes. The control plane
brings the sandbox's storage (a default StorageClass and its local provisioner, cluster.py),
so model-cache claims bind. Nothing here knows rankguard's budget math: the node's ground
truth is a scenario file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from rankguard_sim.kube.cluster import ControlPlane, _die_with_parent, free_port, free_ports
from rankguard_sim.kube.testbin import REPO_ROOT
from rankguard_sim.kubelet.kubelet import ProcessKubelet
from rankguard_sim.kubelet.nodegpus import MigLayout
from rankguard_sim.waiting import wait_for

CRD_FILE = REPO_ROOT / "crds" / "llmservice.yaml"


@dataclass
class OperatorProcess:
    """`python -m rankguard_operator` against a control plane, logs to a file."""

    kubeconfig: Path
    log: Path
    env_extra: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    liveness_port: int = 0
    # Serve the operator's Prometheus metrics on a free loopback port (`metrics_url`); off by
    # default, so parallel sandboxes never race for a port they do not read.
    metrics: bool = False
    metrics_port: int = 0

    def start(self) -> None:
        self.liveness_port, self.metrics_port = free_ports(2) if self.metrics else (free_port(), 0)
        env = dict(os.environ)
        env.update(
            {
                "KUBECONFIG": str(self.kubeconfig),
                "RANKGUARD_LIVENESS_PORT": str(self.liveness_port),
                "RANKGUARD_LIVENESS_HOST": "127.0.0.1",
                "RANKGUARD_METRICS_PORT": str(self.metrics_port),
                "RANKGUARD_METRICS_HOST": "127.0.0.1",
                "RANKGUARD_SCRAPE_INTERVAL": "1",
                "RANKGUARD_AGENT_IMAGE": "ghcr.io/rankguard/agent:0.1.0",
                "PYTHONUNBUFFERED": "1",
                **self.env_extra,
            }
        )
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rankguard_operator"],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl
            )

    def wait_ready(self, timeout: float = 60) -> None:
        import urllib.request  # noqa: PLC0415

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited during start-up; see {self.log}")
            url = f"http://127.0.0.1:{self.liveness_port}/healthz"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the operator was not live after {timeout:.0f}s; see {self.log}")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def metrics_url(self) -> str:
        if not self.metrics_port:
            raise RuntimeError("metrics are off: create the OperatorProcess with metrics=True")
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics_text(self, timeout: float = 5) -> str:
        """The operator's /metrics page as Prometheus' text format."""
        import urllib.request  # noqa: PLC0415

        with urllib.request.urlopen(self.metrics_url, timeout=timeout) as r:
            return str(r.read().decode())

    def kill(self) -> None:
        """SIGKILL the operator's whole process group, as a node failure or the OOM killer
        would: no shutdown handler runs. `start()` runs it again (fault drills)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, grace: float = 15) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


@dataclass
class Node:
    """A simulated GPU node: a process kubelet over its own GPU folder."""

    kubelet: ProcessKubelet
    name: str

    def stop(self) -> None:
        self.kubelet.stop()


def install_crd(cp: ControlPlane, timeout: float = 60) -> None:
    """Install the LLMService CRD and return once API discovery serves it.

    Established is not enough: discovery can lag behind it, and an operator started in that gap
    scans the API's resources, does not find `llmservices`, and never watches them (kopf
    scans once at start-up). Every caller (tests, demo, benches) therefore waits for discovery.
    """
    cp.kubectl("apply", "--server-side", "--field-manager=rankguard-sandbox", "-f", str(CRD_FILE))
    # Polled rather than `kubectl wait`: a CRD whose status has no conditions yet makes that
    # command fail at once ("accessor error") instead of waiting.
    wait_for(
        "the LLMService CRD to be Established",
        lambda: (
            cp.kubectl(
                "get",
                "crd/llmservices.rankguard.io",
                "-o",
                "jsonpath={.status.conditions[?(@.type=='Established')].status}",
                check=False,
            ).stdout.strip()
            == "True"
        ),
        timeout,
        every=0.3,
    )
    wait_for(
        "API discovery to serve llmservices.rankguard.io",
        lambda: cp.kubectl("get", "llmservices", "-A", check=False).returncode == 0,
        timeout,
        every=0.3,
    )


@contextlib.contextmanager
def operator_running(cp: ControlPlane, log: Path, env_extra: dict[str, str]) -> Iterator[OperatorProcess]:
    """The CRD installed and `python -m rankguard_operator` serving `cp` until the block ends (a
    test tier's session operator; `env_extra` names the namespaces it watches)."""
    install_crd(cp)
    op = OperatorProcess(cp.kubeconfig, log, env_extra=env_extra)
    op.start()
    try:
        op.wait_ready()
        yield op
    finally:
        op.stop()


def start_node(
    api: Any,
    workdir: Path,
    name: str,
    scenario: str,
    *,
    time_scale: float = 1.0,
    backoff_base: float = 0.5,
    backoff_cap: float = 5.0,
    mig: MigLayout | None = None,
    gpus: int | None = None,
    vmm: bool = True,
    imex_channel: bool = False,
) -> Node:
    """A process kubelet for `scenario` (room for two replicas' GPUs, or `gpus`), optionally with
    MIG slices; the control plane's default StorageClass gives its pods PersistentVolumes.

    A multi-node scenario's two replicas are two groups of `nnodes` pods: one node has all their
    GPUs (2 × world size, e.g. 32 for TP8×PP2), or call this once per pod with `gpus=` the
    scenario's local world size (distinct names: four 8-GPU nodes). Every node's pods resolve
    each other's names (kube/dns.py). `vmm=False`: a driver without virtual memory management;
    `imex_channel`: pods find an IMEX channel; `node.kubelet.start_neighbour(gpu, hold, steps)`
    puts a neighbour process on one of its GPUs."""
    kubelet = ProcessKubelet(
        api,
        name,
        workdir=workdir / name,
        gpu_root=workdir / name / "gpus",
        gpus=scenario_gpu_count(scenario) if gpus is None else gpus,
        scenario=scenario,
        backoff_base=backoff_base,
        backoff_cap=backoff_cap,
        delete_node_on_stop=True,
        extra_env={"RANKGUARD_SIM_TIME_SCALE": str(time_scale)},
        mig=mig,
        vmm=vmm,
        imex_channel=imex_channel,
    )
    kubelet.start()
    return Node(kubelet, name)


def scenario_gpu_count(scenario: str) -> int:
    from rankguard_sim.physics.scenario_file import load_scenario  # noqa: PLC0415  # noqa: PLC0415

    s = load_scenario(scenario)
    # One serving replica's GPUs plus room for a second during a roll.
    return int(s.world_size) * 2


@contextlib.contextmanager
def running(api: Any, kubelet: ProcessKubelet, timeout: float = 60) -> Iterator[ProcessKubelet]:
    """Start `kubelet`, wait until its node is schedulable, and stop it afterwards."""
    kubelet.start()
    try:
        wait_node_schedulable(api, kubelet.node_name, timeout)
        yield kubelet
    finally:
        kubelet.stop()


def wait_node_schedulable(api: Any, name: str, timeout: float = 90) -> None:
    from rankguard_sim.kubelet.nodes import node_schedulable  # noqa: PLC0415  # noqa: PLC0415

    wait_for(f"node {name} to become schedulable", lambda: node_schedulable(api, name), timeout, 0.5)


def create_namespace(api: Any, name: str, labels: dict[str, str] | None = None, timeout: float = 30) -> None:
    """Create a namespace and wait for its `default` ServiceAccount, which pods need and the
    controller-manager adds a moment later."""
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name, "labels": dict(labels or {})}})

    def has_default_sa() -> bool:
        return any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(name).items)

    wait_for(f"the default ServiceAccount of namespace {name}", has_default_sa, timeout)


def llmservice(api: Any, namespace: str, name: str) -> dict[str, Any]:
    obj = client.CustomObjectsApi(api).get_namespaced_custom_object(
        "rankguard.io", "v1alpha1", namespace, "llmservices", name
    )
    return dict(obj)
