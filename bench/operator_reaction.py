"""Benchmark: how fast the operator reacts to a CUDA OOM, on the local control plane.

Starts a real control plane (etcd + kube-apiserver + controllers, from the testbin), installs
the CRD, runs the operator exactly as in its container (`python -m rankguard_operator`, a
subprocess, default scrape interval) and creates N LLMServices. Then, one service at a time,
it plays the kubelet: it writes the vLLM container's CUDA OOM termination (the agent's JSON
message on rank 0) into the pod's status, and times from the response to that status patch
(the termination is in the API) to the moment a watch on the Deployments delivers the roll
(a new generation with a smaller `--kv-cache-memory-bytes`). No node is needed; the pods
stay Pending, which the operator does not care about for this path.

Everything runs under one deadline, and the control plane (with every object in it) and the
operator are stopped and removed at the end, whatever happened.

    PYTHONPATH=operator:agent:sim python bench/operator_reaction.py [--trials 20] [--timeout 300]
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, watch

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.names import API_GROUP, API_VERSION, LLMSERVICE_LABEL, PLURAL
from rankguard_operator.core.units import GiB, iso
from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.world import OperatorProcess, install_crd
from scale_measure import percentile

TARGET_P50_SECONDS = 1.0


@dataclass(frozen=True)
class Rolled:
    name: str
    generation: int
    kv_bytes: int | None
    seen_at: float  # time.monotonic() when the watch delivered it


def kv_flag(deployment: Any) -> int | None:
    for c in deployment.spec.template.spec.containers:
        if c.name == "vllm" and "--kv-cache-memory-bytes" in c.command:
            return int(c.command[c.command.index("--kv-cache-memory-bytes") + 1])
    return None


class DeploymentWatch:
    """Every Deployment change in the namespace, time-stamped on arrival, from one watch."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.apps, self.ns = client.AppsV1Api(api), namespace
        self.events: queue.Queue[Rolled] = queue.Queue()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            for ev in self._watch.stream(self.apps.list_namespaced_deployment, self.ns, timeout_seconds=3600):
                seen = time.monotonic()
                d = ev["object"]
                self.events.put(Rolled(d.metadata.name, int(d.metadata.generation), kv_flag(d), seen))
        except Exception as e:  # the control plane stopping under us ends the watch too
            self.error = e

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._watch.stop()

    def wait_roll(self, name: str, after_generation: int, deadline: float) -> Rolled | None:
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if ev.name == name and ev.generation > after_generation:
                return ev
        return None


def wait_for(what: str, probe: Any, deadline: float, every: float = 0.1) -> Any:
    while time.monotonic() < deadline:
        got = probe()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"gave up waiting for {what}")


def service_doc(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "image": "vllm/vllm-openai:v0.33.0",
            "tensorParallelSize": 2,
            "engine": {"maxModelLen": 8192, "maxNumSeqs": 64},
            "memory": {"gpuMemoryBytes": 80 * GiB},
            "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
        },
    }


def oom_status(pod_name: str) -> dict[str, Any]:
    """The pod status a kubelet writes once vLLM died of a CUDA OOM on rank 0 and waits to restart."""
    now = iso(time.time())
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=0,
        gpu_index=0,
        requested_bytes=2 * GiB,
        free_bytes=GiB,
        total_bytes=80 * GiB,
        detail="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    ).to_json()
    terminated = {
        "exitCode": 1,
        "reason": "Error",
        "message": message,
        "startedAt": now,
        "finishedAt": now,
        "containerID": f"containerd://{pod_name}-0",
    }
    return {
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}],
            "containerStatuses": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai:v0.33.0",
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 1,
                    "lastState": {"terminated": terminated},
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                }
            ],
        }
    }


@contextmanager
def sandbox(scrape_interval: float) -> Iterator[tuple[ControlPlane, client.ApiClient, str]]:
    """A control plane with the CRD, one namespace, and the operator watching only it."""
    cp = ControlPlane.start()  # its own temporary folder, removed by stop()
    api: Any = None
    op: OperatorProcess | None = None
    try:
        install_crd(cp)
        api = cp.api_client()
        namespace = f"bench-{uuid.uuid4().hex[:6]}"
        core = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": namespace}})
        wait_for(
            "the default ServiceAccount",
            lambda: any(
                sa.metadata.name == "default" for sa in core.list_namespaced_service_account(namespace).items
            ),
            time.monotonic() + 30,
        )
        log = Path(tempfile.mkdtemp(prefix="rankguard-bench-op-")) / "operator.log"
        op = OperatorProcess(
            cp.kubeconfig,
            log,
            env_extra={
                "RANKGUARD_WATCH_NAMESPACES": namespace,
                "RANKGUARD_SCRAPE_INTERVAL": f"{scrape_interval:g}",
            },
        )
        op.start()
        op.wait_ready()
        yield cp, api, namespace
    finally:
        if op is not None:
            op.stop()
            log_dir = op.log.parent
            for f in log_dir.iterdir():
                f.unlink()
            log_dir.rmdir()
        if api is not None:
            api.close()
        cp.stop()


def run(trials: int, scrape_interval: float, timeout: float) -> tuple[list[float], int]:
    """Reaction times in seconds, and how many trials did not roll in time."""
    deadline = time.monotonic() + timeout
    with sandbox(scrape_interval) as (_cp, api, ns):
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        custom = client.CustomObjectsApi(api)
        names = [f"svc-{i:02d}" for i in range(trials)]
        for name in names:
            custom.create_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL, service_doc(name))

        def all_pods() -> dict[str, str] | None:
            pods = {
                p.metadata.labels.get(LLMSERVICE_LABEL): p.metadata.name
                for p in core.list_namespaced_pod(ns).items
            }
            return pods if all(n in pods for n in names) else None

        pods = wait_for("a pod of every service", all_pods, deadline, every=0.5)
        # Let every service's first pass settle (status written) before timing anything.
        wait_for(
            "every first status",
            lambda: all(
                (
                    custom.get_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL, n).get("status")
                    or {}
                ).get("servingFlags")
                for n in names
            ),
            deadline,
            every=0.5,
        )

        dw = DeploymentWatch(api, ns)
        dw.start()
        time.sleep(1.0)  # the watch's initial ADDED burst goes by before the first trial
        times: list[float] = []
        missed = 0
        try:
            for name in names:
                before = apps.read_namespaced_deployment(name, ns)
                gen, kv = int(before.metadata.generation), kv_flag(before)
                while not dw.events.empty():
                    dw.events.get_nowait()
                core.patch_namespaced_pod_status(
                    pods[name],
                    ns,
                    oom_status(pods[name]),
                    _content_type="application/strategic-merge-patch+json",
                )
                in_api = time.monotonic()
                rolled = dw.wait_roll(name, gen, min(deadline, in_api + 30))
                if rolled is None:
                    missed += 1
                    if time.monotonic() >= deadline:
                        break
                    continue
                if kv is not None and (rolled.kv_bytes is None or rolled.kv_bytes >= kv):
                    raise RuntimeError(
                        f"{name}: the roll did not shrink the budget ({kv} -> {rolled.kv_bytes})"
                    )
                times.append(max(0.0, rolled.seen_at - in_api))
        finally:
            dw.stop()
    return times, missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=20, help="CUDA OOMs, each on a fresh LLMService")
    ap.add_argument(
        "--scrape-interval",
        type=float,
        default=2.0,
        help="the operator's RANKGUARD_SCRAPE_INTERVAL (its default); pod events must not wait for it",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="deadline for the whole run, seconds")
    args = ap.parse_args()

    started = time.monotonic()
    times, missed = run(args.trials, args.scrape_interval, args.timeout)
    took = time.monotonic() - started
    if not times:
        print(f"no roll observed in {args.trials} trials", file=sys.stderr)
        return 1

    p50 = percentile(times, 0.5)

    def ms(s: float) -> str:
        return f"{s * 1000:.0f} ms"

    rows = [
        ("trials", f"{len(times)} rolled", f"{missed} missed", "" if not missed else "MISSED"),
        ("p50", ms(p50), "termination -> roll", "ok" if p50 < TARGET_P50_SECONDS else "over 1 s"),
        ("p90", ms(percentile(times, 0.9)), "", ""),
        ("p99", ms(percentile(times, 0.99)), "", ""),
        ("max", ms(max(times)), "", ""),
        ("min", ms(min(times)), "", ""),
    ]
    print(
        f"operator reaction time: {args.trials} CUDA OOMs, scrape interval {args.scrape_interval:g} s, "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, {took:.0f} s in all"
    )
    print()
    print(f"| {'measure':<8} | {'value':<10} | {'detail':<22} | {'target p50 < 1 s':<16} |")
    print(f"|{'-' * 10}|{'-' * 12}|{'-' * 24}|{'-' * 18}|")
    for name, value, detail, verdict in rows:
        print(f"| {name:<8} | {value:<10} | {detail:<22} | {verdict:<16} |")
    return 0 if p50 < TARGET_P50_SECONDS and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
