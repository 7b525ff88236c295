"""The process kubelet against the real control plane: pods run, report and stop like a kubelet's.

(Over 450 lines because each kubelet duty, from admission to graceful deletion, is one story
against the same node and control plane; the pure rules are in tests/unit/sim/kubelet/.)
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from manifests import deployment_manifest, pod_manifest

from rankguard_sim.fake_vllm.args import VLLM_VERSION
from rankguard_sim.kubelet.kubelet import ProcessKubelet, wait_for_pids_gone
from rankguard_sim.kubelet.nodes import node_schedulable
from rankguard_sim.physics import gpus as simgpus
from rankguard_sim.physics.scenario_file import load_scenario
from rankguard_sim.waiting import let_time_pass, wait_for

pytestmark = pytest.mark.cluster

SCENARIO = "llama3-70b-tp4"
HOLD = "rankguard.io/test-hold"  # a finalizer that keeps a deleted pod around


def start_kubelet(api: client.ApiClient, root: Path, **kwargs: Any) -> ProcessKubelet:
    name = f"kl-{uuid.uuid4().hex[:6]}"
    kubelet = ProcessKubelet(
        api, name, workdir=root / "kubelet", gpu_root=root / "gpus", delete_node_on_stop=True, **kwargs
    )
    kubelet.start()
    wait_for("the node to become schedulable", lambda: node_schedulable(api, name), timeout=60, every=0.3)
    return kubelet


@pytest.fixture(scope="module")
def kubelet(api: client.ApiClient, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessKubelet]:
    k = start_kubelet(
        api,
        tmp_path_factory.mktemp("kubelet"),
        gpus=4,
        scenario=SCENARIO,
        backoff_base=1.0,
        backoff_cap=2.0,
        extra_env={"RANKGUARD_SIM_TIME_SCALE": "0.5"},
    )
    try:
        yield k
    finally:
        k.stop()


def raw_pod(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    resp = client.CoreV1Api(api).read_namespaced_pod(name, namespace, _preload_content=False)
    return dict(json.loads(resp.data))


def container_status(pod: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    key = "initContainerStatuses" if init else "containerStatuses"
    for s in (pod.get("status") or {}).get(key) or []:
        if s["name"] == name:
            return dict(s)
    return {}


def condition(pod: dict[str, Any], kind: str) -> str:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return str(c["status"])
    return ""


def delete_and_wait(api: client.ApiClient, namespace: str, name: str, timeout: float = 30) -> None:
    core = client.CoreV1Api(api)
    core.delete_namespaced_pod(name, namespace)

    def gone() -> bool:
        try:
            core.read_namespaced_pod(name, namespace)
        except ApiException as e:
            return bool(e.status == 404)
        return False

    wait_for(f"pod {name} to be deleted", gone, timeout=timeout)


def pod_when(
    api: client.ApiClient, namespace: str, name: str, test: Callable[[dict[str, Any]], bool]
) -> Callable[[], dict[str, Any] | None]:
    def probe() -> dict[str, Any] | None:
        pod = raw_pod(api, namespace, name)
        return pod if test(pod) else None

    return probe


def phase_is(phase: str) -> Callable[[dict[str, Any]], bool]:
    return lambda pod: bool((pod.get("status") or {}).get("phase") == phase)


def terminated(api: client.ApiClient, namespace: str, name: str, container: str) -> Callable[[], Any]:
    return lambda: (
        container_status(raw_pod(api, namespace, name), container).get("state", {}).get("terminated")
    )


HTTP_SERVER = (
    "import http.server, os, sys\n"
    "print('gpus', os.environ['NVIDIA_VISIBLE_DEVICES'], flush=True)\n"
    "http.server.HTTPServer((sys.argv[1], 8000), http.server.SimpleHTTPRequestHandler).serve_forever()\n"
)


def test_deployment_pod_is_ready_on_its_loopback_ip_and_deleting_it_stops_everything(
    api: client.ApiClient, namespace: str, kubelet: ProcessKubelet
) -> None:
    apps = client.AppsV1Api(api)
    container = {
        "name": "main",
        "image": "python:3.11",
        "command": ["python3", "-c", HTTP_SERVER, "$(POD_IP)"],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "resources": {"limits": {"nvidia.com/gpu": "2", "memory": "1Gi"}},
        "readinessProbe": {"httpGet": {"port": "http", "path": "/"}, "periodSeconds": 1},
    }
    apps.create_namespaced_deployment(namespace, deployment_manifest(kubelet.node_name, "web", [container]))
    core = client.CoreV1Api(api)
    name = wait_for(
        "the Deployment's pod", lambda: [p.metadata.name for p in core.list_namespaced_pod(namespace).items]
    )[0]
    pod = wait_for(
        "the pod to be Ready",
        pod_when(api, namespace, name, lambda p: condition(p, "Ready") == "True"),
    )
    status = pod["status"]
    assert status["phase"] == "Running"
    assert re.fullmatch(r"127\.0\.0\.(\d+)", status["podIP"]) and status["podIP"] != "127.0.0.1"
    assert status["podIPs"] == [{"ip": status["podIP"]}] and status["hostIP"] == "127.0.0.1"
    assert [c["type"] for c in status["conditions"] if c["status"] == "True"] == [
        "PodReadyToStartContainers",
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    ]
    main = container_status(pod, "main")
    assert main["ready"] is True and main["started"] is True and main["restartCount"] == 0
    assert "running" in main["state"] and main["containerID"].startswith("rankguard-process://")
    with urllib.request.urlopen(f"http://{status['podIP']}:8000/", timeout=5) as r:
        assert r.status == 200

    # The pod's GPUs: what the kubelet assigned, what the container saw, what the scenario costs.
    assigned = kubelet.gpu_assignments()[f"{namespace}/{name}"]
    assert len(assigned) == 2 and not set(assigned) & set(kubelet.free_gpus())
    log_path = kubelet.log_path(namespace, name, "main")
    assert log_path is not None and f"gpus {','.join(assigned)}" in log_path.read_text()
    scenario = load_scenario(SCENARIO)
    for rank, gpu in enumerate(assigned):
        assert simgpus.read_device(kubelet.gpu_root, gpu).comm_init_bytes == scenario.comm_init_bytes(rank)

    pids = kubelet.pod_pids(namespace, name)
    assert pids and int(main["containerID"].rsplit("/", 1)[1]) in pids
    apps.delete_namespaced_deployment("web", namespace, propagation_policy="Foreground")
    wait_for("the pod to be gone", lambda: not core.list_namespaced_pod(namespace).items, timeout=60)
    assert wait_for_pids_gone(pids) == []
    assert set(assigned) <= set(kubelet.free_gpus())


def test_crash_loop_reports_the_termination_message_restart_count_and_back_off(
    api: client.ApiClient, namespace: str, kubelet: ProcessKubelet
) -> None:
    crash = (
        "import sys\n"
        "open(sys.argv[1], 'w').write('bad config: no model')\n"
        "print('crashing', flush=True)\n"
        "sys.exit(3)\n"
    )
    manifest = pod_manifest(
        kubelet.node_name,
        "crasher",
        [
            {
                "name": "main",
                "image": "python:3.11",
                "command": ["python3", "-c", crash, "/dev/termination-log"],
            }
        ],
        restartPolicy="Always",
    )
    client.CoreV1Api(api).create_namespaced_pod(namespace, manifest)
    waiting_reasons: set[str] = set()
    messages: set[str] = set()

    def restarted_twice() -> dict[str, Any] | None:
        pod = raw_pod(api, namespace, "crasher")
        main = container_status(pod, "main")
        waiting = main.get("state", {}).get("waiting") or {}
        if waiting:
            waiting_reasons.add(waiting.get("reason", ""))
            messages.add(waiting.get("message", ""))
        return pod if main.get("restartCount", 0) >= 2 else None

    pod = wait_for("two restarts", restarted_twice, timeout=30, every=0.05)
    main = container_status(pod, "main")
    last = main["lastState"]["terminated"]
    assert last["exitCode"] == 3 and last["reason"] == "Error"
    assert last["message"] == "bad config: no model"
    assert last["containerID"].startswith("rankguard-process://") and last["startedAt"] <= last["finishedAt"]
    assert "CrashLoopBackOff" in waiting_reasons
    assert any(m.startswith("back-off 1s restarting failed container=main pod=crasher_") for m in messages)
    assert pod["status"]["phase"] == "Running"
    assert condition(pod, "Ready") == "False"
    delete_and_wait(api, namespace, "crasher")


def test_a_pod_held_by_a_finalizer_is_stopped_on_deletion_and_never_restarted(
    api: client.ApiClient, namespace: str, kubelet: ProcessKubelet
) -> None:
    """A deleted pod's containers stop for good, whatever holds the object (a finalizer keeps
    it, with its last status, for as long as someone wants): as the kubelet, which starts no
    container of a pod with a deletionTimestamp, not even one in CrashLoopBackOff whose back-off
    runs out, nor when the terminating pod is changed (labels, ownerReferences patched on)."""
    core = client.CoreV1Api(api)
    crash = "import sys\nopen(sys.argv[1], 'w').write('claim')\nsys.exit(3)\n"
    manifest = pod_manifest(
        kubelet.node_name,
        "held",
        [
            {
                "name": "main",
                "image": "python:3.11",
                "command": ["python3", "-c", crash, "/dev/termination-log"],
            }
        ],
        restartPolicy="Always",
        terminationGracePeriodSeconds=1,
    )
    manifest["metadata"]["finalizers"] = [HOLD]
    core.create_namespaced_pod(namespace, manifest)
    try:
        wait_for(
            "a restart",
            pod_when(
                api, namespace, "held", lambda p: container_status(p, "main").get("restartCount", 0) >= 1
            ),
            timeout=30,
            every=0.05,
        )
        core.delete_namespaced_pod("held", namespace)
        # the kubelet's last word on it: the final status, then the deletion confirmed (grace 0)
        stopped = wait_for(
            "the kubelet to stop the pod and confirm its deletion",
            pod_when(
                api,
                namespace,
                "held",
                lambda p: (
                    p["metadata"].get("deletionGracePeriodSeconds") == 0
                    and p["status"].get("phase") in ("Failed", "Succeeded")
                ),
            ),
            timeout=30,
        )
        runs = container_status(stopped, "main")["restartCount"]
        # its last run, ended, not a CrashLoopBackOff with a restart to come (the run the
        # deletion found, if one was starting: stopped by SIGTERM)
        last = container_status(stopped, "main")["state"].get("terminated")
        assert last and last["exitCode"] in (3, 143), stopped["status"]
        # a change to the terminating pod reaches the kubelet's watch too
        core.patch_namespaced_pod("held", namespace, {"metadata": {"labels": {"patched": "yes"}}})
        # Letting time pass is the point: three back-off caps, in which a crash-looping
        # container not meant to stop would have been started again.
        restarted = let_time_pass(
            3 * kubelet.backoff_cap,
            stop=lambda: (
                container_status(raw_pod(api, namespace, "held"), "main")["restartCount"] != runs
                or kubelet.pod_pids(namespace, "held")
            ),
        )
        now = raw_pod(api, namespace, "held")
        assert not restarted, f"restarted while being deleted: {container_status(now, 'main')}"
        assert container_status(now, "main")["state"].get("terminated")
    finally:
        core.patch_namespaced_pod("held", namespace, [{"op": "remove", "path": "/metadata/finalizers"}])
    wait_for(
        "the pod to go",
        lambda: not [p for p in core.list_namespaced_pod(namespace).items if p.metadata.name == "held"],
    )


def test_fallback_to_logs_file_policy_and_completed_containers(
    api: client.ApiClient, namespace: str, kubelet: ProcessKubelet
) -> None:
    noisy = "import sys\nfor i in range(100): print(f'line {i}')\nsys.exit(2)\n"
    manifest = pod_manifest(
        kubelet.node_name,
        "mixed",
        [
            {
                "name": "noisy",
                "image": "python:3.11",
                "command": ["python3", "-c", noisy],
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            },
            {
                "name": "quiet",
                "image": "python:3.11",
                "command": ["python3", "-c", "import sys; sys.exit(1)"],
            },
            {"name": "fine", "image": "python:3.11", "command": ["python3", "-c", "print('ok')"]},
        ],
    )
    client.CoreV1Api(api).create_namespaced_pod(namespace, manifest)
    pod = wait_for(
        "the pod to fail",
        pod_when(api, namespace, "mixed", phase_is("Failed")),
    )
    noisy_state = container_status(pod, "noisy")["state"]["terminated"]
    assert noisy_state["exitCode"] == 2 and noisy_state["reason"] == "Error"
    assert noisy_state["message"] == "".join(f"line {i}\n" for i in range(20, 100))
    quiet = container_status(pod, "quiet")["state"]["terminated"]
    assert quiet["exitCode"] == 1 and "message" not in quiet  # File policy, empty file: no message
    fine = container_status(pod, "fine")["state"]["terminated"]
    assert fine["exitCode"] == 0 and fine["reason"] == "Completed"
    assert condition(pod, "Ready") == "False"
    # A finished pod gives its GPU back before it is deleted, as the device plugin does.
    wait_for("the GPU to be released", lambda: f"{namespace}/mixed" not in kubelet.gpu_assignments())
    assert len(kubelet.free_gpus()) == 4
    delete_and_wait(api, namespace, "mixed")


def test_unknown_command_fails_to_start_with_a_clear_reason(
    api: client.ApiClient, namespace: str, kubelet: ProcessKubelet
) -> None:
    manifest = pod_manifest(
        kubelet.node_name, "nosuch", [{"name": "main", "image": "cuda:12", "command": ["nvidia-smi"]}]
    )
    client.CoreV1Api(api).create_namespaced_pod(namespace, manifest)
    state = wait_for("the start error", terminated(api, namespace, "nosuch", "main"))
    assert state["reason"] == "StartError" and state["exitCode"] == 128
    assert state["startedAt"] == "1970-01-01T00:00:00Z"  # never started, as containerd reports it
    assert 'exec: "nvidia-smi": executable file not found in $PATH' in state["message"]
    assert raw_pod(api, namespace, "nosuch")["status"]["phase"] == "Failed"
    delete_and_wait(api, namespace, "nosuch")


def test_host_memory_over_the_limit_is_oom_killed_with_everything_in_the_container(
    api: client.ApiClient, namespace: str, kubelet: ProcessKubelet
) -> None:
    hog = (
        "import json, os, subprocess, sys, time\n"
        "sleeper = [sys.executable, '-c', 'import time; time.sleep(60)']\n"
        "child = subprocess.Popen(sleeper, start_new_session=True)\n"
        "print('child', child.pid, flush=True)\n"
        "time.sleep(0.3)\n"
        "path = os.environ['RANKGUARD_SIM_HOST_MEMORY_FILE']\n"
        "json.dump({'pid': os.getpid(), 'rss_bytes': 100 * 2**20}, open(path + '.tmp', 'w'))\n"
        "os.replace(path + '.tmp', path)\n"
        "time.sleep(60)\n"
    )
    manifest = pod_manifest(
        kubelet.node_name,
        "hog",
        [
            {
                "name": "main",
                "image": "python:3.11",
                "command": ["python3", "-c", hog],
                "resources": {"limits": {"memory": "64Mi"}},
            }
        ],
    )
    client.CoreV1Api(api).create_namespaced_pod(namespace, manifest)
    state = wait_for("the OOM kill", terminated(api, namespace, "hog", "main"))
    assert state["reason"] == "OOMKilled" and state["exitCode"] == 137
    log_path = kubelet.log_path(namespace, "hog", "main")
    assert log_path is not None
    child = int(re.search(r"child (\d+)", log_path.read_text()).group(1))  # type: ignore[union-attr]
    assert wait_for_pids_gone([child]) == []
    assert raw_pod(api, namespace, "hog")["status"]["phase"] == "Failed"
    delete_and_wait(api, namespace, "hog")


def test_init_containers_install_the_agent_into_an_empty_dir_it_then_runs_from(
    api: client.ApiClient, namespace: str, kubelet: ProcessKubelet
) -> None:
    check = (
        "import importlib.util, os, subprocess, sys, rankguard_agent\n"
        "print('agent', rankguard_agent.__file__)\n"
        "print('sim', importlib.util.find_spec('rankguard_sim'))\n"
        "print('args', sys.argv[1:])\n"
        "print('greeting', os.environ['GREETING'])\n"
        "print('world', os.environ['RANKGUARD_SIM_SCENARIO'], os.environ['RANKGUARD_SIM_TIME_SCALE'])\n"
        "print('namespace', open(sys.argv[4]).read())\n"
        "vllm = subprocess.run(['vllm', '--version'], capture_output=True, text=True)\n"
        "print('vllm', vllm.stdout.strip())\n"
    )
    mount = [{"name": "agent", "mountPath": "/opt/rankguard"}]
    manifest = pod_manifest(
        kubelet.node_name,
        "agent",
        [
            {
                "name": "main",
                "image": "python:3.11",
                "command": ["python3", "-c", check],
                "args": [
                    "$(POD_NAME)",
                    "$$(POD_NAME)",
                    "/opt/rankguard/agent/x",
                    "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
                ],
                "env": [
                    {"name": "PYTHONPATH", "value": "/opt/rankguard/agent"},
                    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                    {"name": "GREETING", "value": "hi $(POD_NAME)"},
                ],
                "volumeMounts": mount,
            }
        ],
        initContainers=[
            {
                "name": "install",
                "image": "rankguard/agent:dev",
                "command": ["rankguard-agent-install", "/opt/rankguard/agent"],
                "volumeMounts": mount,
            },
            {"name": "second", "image": "python:3.11", "command": ["python3", "-c", "print('second')"]},
        ],
        volumes=[{"name": "agent", "emptyDir": {}}],
    )
    client.CoreV1Api(api).create_namespaced_pod(namespace, manifest)
    pod = wait_for(
        "the pod to succeed",
        pod_when(api, namespace, "agent", phase_is("Succeeded")),
    )
    for name in ("install", "second"):
        s = container_status(pod, name, init=True)
        assert s["state"]["terminated"]["reason"] == "Completed" and s["ready"] is True
    assert container_status(pod, "main")["state"]["terminated"]["exitCode"] == 0
    log_path = kubelet.log_path(namespace, "agent", "main")
    assert log_path is not None
    out = log_path.read_text()
    agent_file = re.search(r"^agent (.+)$", out, re.M).group(1)  # type: ignore[union-attr]
    volume = log_path.parents[2] / "volumes" / "agent"
    assert agent_file == str(volume / "agent" / "rankguard_agent" / "__init__.py")
    assert "sim None" in out
    assert f"args ['agent', '$(POD_NAME)', '{volume}/agent/x', " in out
    assert "greeting hi agent" in out
    assert f"world {SCENARIO} 0.5" in out
    # The service-account volume the API server adds to every pod is there, token and all.
    assert f"namespace {namespace}" in out
    token_files = list((log_path.parents[2] / "volumes").glob("kube-api-access-*/token"))
    assert token_files and token_files[0].read_text().count(".") == 2  # a signed JWT
    # A command run inside the container finds the sandbox's `vllm` on PATH: the fake one.
    assert f"vllm {VLLM_VERSION}" in out
    delete_and_wait(api, namespace, "agent")


def test_probes_liveness_restarts_and_exec_readiness(
    api: client.ApiClient, namespace: str, kubelet: ProcessKubelet
) -> None:
    sleep = ["python3", "-c", "import time; time.sleep(60)"]

    def exec_probe(code: int) -> dict[str, Any]:
        return {"exec": {"command": ["python3", "-c", f"import sys; sys.exit({code})"]}, "periodSeconds": 1}

    manifest = pod_manifest(
        kubelet.node_name,
        "probed",
        [
            {
                "name": "deaf",
                "image": "python:3.11",
                "command": sleep,
                "livenessProbe": {"tcpSocket": {"port": 9}, "periodSeconds": 1, "failureThreshold": 1},
            },
            {"name": "ready", "image": "python:3.11", "command": sleep, "readinessProbe": exec_probe(0)},
            {"name": "unready", "image": "python:3.11", "command": sleep, "readinessProbe": exec_probe(1)},
        ],
        restartPolicy="Always",
        terminationGracePeriodSeconds=1,
    )
    client.CoreV1Api(api).create_namespaced_pod(namespace, manifest)

    def settled(pod: dict[str, Any]) -> bool:
        return (
            bool(container_status(pod, "deaf").get("restartCount"))
            and container_status(pod, "ready")["ready"]
        )

    pod = wait_for("a liveness restart and a ready container", pod_when(api, namespace, "probed", settled))
    deaf = container_status(pod, "deaf")
    assert deaf["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM, as the kubelet's kill sends
    unready = container_status(pod, "unready")
    assert unready["ready"] is False and unready["started"] is True and "running" in unready["state"]
    assert condition(pod, "Ready") == "False" and condition(pod, "ContainersReady") == "False"
    delete_and_wait(api, namespace, "probed")


def printed_up(kubelet: ProcessKubelet, namespace: str, name: str) -> bool:
    log_path = kubelet.log_path(namespace, name, "main")
    return log_path is not None and log_path.exists() and "up" in log_path.read_text().split()


def test_force_deletion_grace_periods_and_stop_leave_no_process_or_thread(
    api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    threads_before = {t.ident for t in threading.enumerate()}
    kubelet = start_kubelet(api, tmp_path, gpus=2)
    core = client.CoreV1Api(api)
    stubborn = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    try:
        # Cut the kubelet's pod watch as a dropped connection would: it must relist and carry on.
        resp = wait_for("the pod watch", lambda: kubelet._watch_resp)
        resp.shutdown()
        for name in ("forced", "stubborn", "survivor"):
            core.create_namespaced_pod(
                namespace,
                pod_manifest(
                    kubelet.node_name,
                    name,
                    [
                        {
                            "name": "main",
                            "image": "python:3.11",
                            "command": ["python3", "-c", stubborn],
                            "resources": {"limits": {"nvidia.com/gpu": "1"}} if name != "survivor" else {},
                        }
                    ],
                    terminationGracePeriodSeconds=1,
                ),
            )
        pids: dict[str, list[int]] = {}
        for name in ("forced", "stubborn", "survivor"):
            pids[name] = wait_for(f"{name} to run", functools.partial(kubelet.pod_pids, namespace, name))
        # A SIGTERM that lands before the child has installed SIG_IGN kills it at once, so wait for
        # the line it prints after doing so.
        wait_for("stubborn to ignore SIGTERM", functools.partial(printed_up, kubelet, namespace, "stubborn"))
        # Force deletion: the pod object is gone at once; the kubelet still kills what ran.
        core.delete_namespaced_pod("forced", namespace, grace_period_seconds=0)
        assert wait_for_pids_gone(pids["forced"], timeout=10) == []
        # SIGTERM is ignored: the kubelet waits the grace period, then SIGKILLs.
        started = time.monotonic()
        delete_and_wait(api, namespace, "stubborn")
        assert time.monotonic() - started >= 0.9
        assert wait_for_pids_gone(pids["stubborn"]) == []
        wait_for("both GPUs to be free", lambda: len(kubelet.free_gpus()) == 2)
    finally:
        kubelet.stop()
    assert wait_for_pids_gone(pids["survivor"], timeout=5) == []
    assert kubelet.all_pids() == []
    leftover = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    assert not [n for n in leftover if n.startswith(("kubelet-", "pod-"))]
    with pytest.raises(ApiException) as gone:
        core.read_node(kubelet.node_name)
    assert gone.value.status == 404
    # The survivor was never deleted: finish it as a kubelet would, so the namespace can go.
    core.delete_namespaced_pod("survivor", namespace, grace_period_seconds=0)
