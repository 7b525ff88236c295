"""The process kubelet's pure rules: expansion, env, paths, commands, status, probes, back-off.

(Over 450 lines: one section per rule of the kubelet, each short; they share the pod fixtures.)
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_sim.kubelet.agent_install import install
from rankguard_sim.kubelet.image import build_image
from rankguard_sim.kubelet.kubelet import ProcessKubelet
from rankguard_sim.kubelet.podproc import CONTAINER_ENV, container_pids, exit_from_returncode
from rankguard_sim.kubelet.podspec import (
    ImageTable,
    IpPool,
    PathMap,
    PodFacts,
    SpecError,
    backoff_delay,
    container_argv,
    container_env,
    expand,
    image_repository,
    memory_limit_bytes,
    pod_gpu_count,
    quantity_bytes,
    resolve_executable,
)
from rankguard_sim.kubelet.podstatus import (
    ContainerView,
    Termination,
    container_status,
    crash_loop_message,
    exit_reason,
    log_tail,
    pod_conditions,
    pod_phase,
    pod_status,
    termination_message,
)
from rankguard_sim.kubelet.podvolumes import volume_files
from rankguard_sim.kubelet.probes import ProbeSpec, ProbeTimer, check_http, check_tcp, parse_probe

FACTS = PodFacts(
    pod_ip="127.0.0.7", host_ip="127.0.0.1", node_name="gpu-1", node_allocatable={"memory": "8Gi"}
)
POD: dict[str, Any] = {
    "metadata": {"name": "web-0", "namespace": "ns1", "uid": "u-1", "labels": {"app": "x"}},
    "spec": {"serviceAccountName": "sa"},
}

# ------------------------------------------------------------------------------ expansion


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "alpha"),
        ("x-$(A)-$(B)", "x-alpha-beta"),
        ("$$(A)", "$(A)"),  # escaped: not a reference
        ("$$$(A)", "$alpha"),
        ("$(MISSING)", "$(MISSING)"),  # unknown names stay as written
        ("$(A", "$(A"),  # unclosed
        ("cost $5", "cost $5"),
        ("trailing $", "trailing $"),
        ("$()", "$()"),
        ("", ""),
    ],
)
def test_expand_follows_the_kubelet_rules(text: str, expected: str) -> None:
    assert expand(text, {"A": "alpha", "B": "beta"}) == expected


@given(st.text(alphabet="ab$()XY", max_size=30))
def test_escaping_every_dollar_makes_expansion_the_identity(text: str) -> None:
    assert expand(text.replace("$", "$$"), {"X": "1", "Y": "2"}) == text


# ------------------------------------------------------------------------------ env


def test_env_values_expand_against_earlier_variables_only() -> None:
    container = {
        "env": [
            {"name": "LATER_REF", "value": "$(B)"},
            {"name": "B", "value": "b"},
            {"name": "C", "value": "$(B)/$(POD_IP)"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "D", "value": "$(POD_IP)"},
        ]
    }
    env = container_env(POD, container, FACTS)
    assert env == {"LATER_REF": "$(B)", "B": "b", "C": "b/$(POD_IP)", "POD_IP": "127.0.0.7", "D": "127.0.0.7"}


def test_downward_api_field_refs() -> None:
    paths = [
        "metadata.name",
        "metadata.namespace",
        "metadata.uid",
        "spec.nodeName",
        "status.hostIP",
        "spec.serviceAccountName",
        "metadata.labels['app']",
    ]
    container = {
        "env": [{"name": f"V{i}", "valueFrom": {"fieldRef": {"fieldPath": p}}} for i, p in enumerate(paths)]
    }
    env = container_env(POD, container, FACTS)
    assert list(env.values()) == ["web-0", "ns1", "u-1", "gpu-1", "127.0.0.1", "sa", "x"]
    with pytest.raises(SpecError, match="unsupported fieldRef"):
        container_env(
            POD, {"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.nope"}}}]}, FACTS
        )


def test_resource_field_refs_round_up_by_divisor_and_default_to_node_allocatable() -> None:
    container = {
        "resources": {"limits": {"memory": "1Gi", "cpu": "1500m"}},
        "env": [
            {
                "name": "MEM_MI",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "REQ_MEM", "valueFrom": {"resourceFieldRef": {"resource": "requests.memory"}}},
        ],
    }
    env = container_env(POD, container, FACTS)
    assert env == {"MEM_MI": "1024", "CPU": "2", "REQ_MEM": str(1 << 30)}
    unlimited = {"env": [{"name": "M", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory"}}}]}
    assert container_env(POD, unlimited, FACTS)["M"] == str(8 << 30)


def test_config_map_and_secret_refs_use_the_lookups_and_honour_optional() -> None:
    objects = {("configmap", "ns1", "cm"): {"k": "from-cm"}, ("secret", "ns1", "s"): {"token": "t0p"}}

    def obj(kind: str, ns: str, name: str) -> dict[str, str] | None:
        return objects.get((kind, ns, name))

    def key(kind: str, ns: str, name: str, k: str) -> str | None:
        data = obj(kind, ns, name)
        return None if data is None else data.get(k)

    container = {
        "envFrom": [
            {"configMapRef": {"name": "cm"}, "prefix": "CM_"},
            {"secretRef": {"name": "gone", "optional": True}},
        ],
        "env": [
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {
                "name": "OPT",
                "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "nope", "optional": True}},
            },
        ],
    }
    assert container_env(POD, container, FACTS, key, obj) == {"CM_k": "from-cm", "TOKEN": "t0p"}
    missing = {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "nope"}}}]}
    with pytest.raises(SpecError) as err:
        container_env(POD, missing, FACTS, key, obj)
    assert err.value.reason == "CreateContainerConfigError"


# ------------------------------------------------------------------------------ paths


def test_path_map_rewrites_whole_segments_longest_mount_first() -> None:
    pm = PathMap.build(
        [
            ("/opt/rankguard", "/tmp/p/vol-a"),
            ("/opt/rankguard/agent", "/tmp/p/vol-b"),
            ("/data/", "/tmp/p/d"),
        ],
        [("/dev/termination-log", "/tmp/p/c/termination-log")],
    )
    assert pm.path("/opt/rankguard") == "/tmp/p/vol-a"
    assert pm.path("/opt/rankguard/x.py") == "/tmp/p/vol-a/x.py"
    assert pm.path("/opt/rankguard/agent/rankguard_agent") == "/tmp/p/vol-b/rankguard_agent"
    assert pm.path("/opt/rankguardian") == "/opt/rankguardian"  # not a path segment match
    assert pm.path("/data/f") == "/tmp/p/d/f"
    assert pm.path("/dev/termination-log") == "/tmp/p/c/termination-log"
    assert pm.path("/dev/termination-log2") == "/dev/termination-log2"
    assert pm.arg("--termination-log=/dev/termination-log") == "--termination-log=/tmp/p/c/termination-log"
    assert pm.arg("--out=/opt/rankguard/o") == "--out=/tmp/p/vol-a/o"
    assert pm.arg("key=/opt/rankguard") == "key=/opt/rankguard"  # only flags get the `=` treatment
    assert pm.env_value("/opt/rankguard/agent:/usr/lib/py") == "/tmp/p/vol-b:/usr/lib/py"
    assert pm.env_value("http://example.invalid:80/") == "http://example.invalid:80/"


# ------------------------------------------------------------------------------ commands

TABLE = ImageTable(
    commands={"python3": "/sandbox/bin/python3", "vllm": "/sandbox/bin/vllm"},
    entrypoints={"vllm/vllm-openai": (("vllm", "serve"), ()), "python": ((), ("python3",))},
)


def test_command_args_and_image_entrypoints() -> None:
    env = {"MODEL": "m", "PORT": "8000"}
    assert container_argv({"command": ["python3", "-m", "x"], "args": ["--port", "$(PORT)"]}, TABLE, env) == [
        "python3",
        "-m",
        "x",
        "--port",
        "8000",
    ]
    # args only: the image's ENTRYPOINT + the container's args (the image's CMD is dropped)
    assert container_argv(
        {"image": "docker.io/vllm/vllm-openai:v0.9.1", "args": ["$(MODEL)"]}, TABLE, env
    ) == [
        "vllm",
        "serve",
        "m",
    ]
    assert container_argv({"image": "python:3.11"}, TABLE, env) == ["python3"]
    with pytest.raises(SpecError, match="no command specified"):
        container_argv({"image": "example.invalid/unknown:1"}, TABLE, env)


def test_unknown_commands_fail_like_a_runtime_and_name_the_table() -> None:
    assert resolve_executable("vllm", TABLE) == "/sandbox/bin/vllm"
    with pytest.raises(SpecError) as err:
        resolve_executable("nvidia-smi", TABLE)
    assert err.value.reason == "StartError"
    assert 'exec: "nvidia-smi": executable file not found in $PATH' in err.value.message
    assert "python3" in err.value.message


@pytest.mark.parametrize(
    ("image", "repo"),
    [
        ("vllm/vllm-openai:v0.9.1", "vllm/vllm-openai"),
        ("docker.io/vllm/vllm-openai@sha256:abc", "vllm/vllm-openai"),
        ("localhost:5000/team/img:1", "team/img"),
        ("docker.io/library/python:3.11", "python"),
        ("python", "python"),
    ],
)
def test_image_repository(image: str, repo: str) -> None:
    assert image_repository(image) == repo


# ------------------------------------------------------------------------------ small rules


def test_backoff_doubles_from_base_up_to_cap() -> None:
    assert [backoff_delay(n, 0.5, 3.0) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff_delay(10_000, 10, 300) == 300


def test_ip_pool_hands_out_the_lowest_free_address_and_reuses_it() -> None:
    pool = IpPool(first=2, last=4)
    assert [pool.acquire(o) for o in ("a", "b", "c")] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert pool.acquire("b") == "127.0.0.3"  # same owner, same address
    with pytest.raises(SpecError):
        pool.acquire("d")
    pool.release("b")
    assert pool.acquire("d") == "127.0.0.3"
    assert pool.in_use() == {"a": "127.0.0.2", "c": "127.0.0.4", "d": "127.0.0.3"}


def test_gpu_and_memory_quantities() -> None:
    pod = {
        "spec": {
            "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}],
            "containers": [
                {"resources": {"limits": {"nvidia.com/gpu": "2"}}},
                {"resources": {"limits": {"nvidia.com/gpu": 1}}},
            ],
        }
    }
    assert pod_gpu_count(pod) == 4
    pod["spec"]["initContainers"] = []
    assert pod_gpu_count(pod) == 3
    assert quantity_bytes("1Gi") == 1 << 30
    assert quantity_bytes("1.5M") == 1_500_000
    assert memory_limit_bytes({"resources": {"limits": {"memory": "64Mi"}}}) == 64 << 20
    assert memory_limit_bytes({}) is None


# ------------------------------------------------------------------------------ status


def _term(code: int, reason: str = "", message: str = "") -> Termination:
    return Termination(
        code, reason or exit_reason(code, False), 100.0, 160.0, message, "rankguard-process://9"
    )


def test_container_status_shapes() -> None:
    waiting = ContainerView("main", "img", waiting_reason="CrashLoopBackOff", waiting_message="back-off 1s")
    waiting.last_terminated, waiting.restart_count = _term(3, message="boom"), 1
    s = container_status(waiting)
    assert s["state"] == {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1s"}}
    assert s["lastState"]["terminated"] == {
        "exitCode": 3,
        "reason": "Error",
        "message": "boom",
        "startedAt": "1970-01-01T00:01:40Z",
        "finishedAt": "1970-01-01T00:02:40Z",
        "containerID": "rankguard-process://9",
    }
    assert s["restartCount"] == 1 and s["ready"] is False and "containerID" not in s
    running = ContainerView(
        "main", "img", state="running", started_at=3600, container_id="rankguard-process://5"
    )
    running.ready = running.started = True
    s = container_status(running)
    assert s["state"] == {"running": {"startedAt": "1970-01-01T01:00:00Z"}}
    assert s["lastState"] == {} and s["containerID"] == "rankguard-process://5" and s["ready"] is True
    killed = ContainerView(
        "main", "img", state="terminated", terminated=Termination(137, "OOMKilled", 1, 2, signal=9)
    )
    assert container_status(killed)["state"]["terminated"]["reason"] == "OOMKilled"
    assert container_status(killed)["state"]["terminated"]["signal"] == 9


def _view(state: str, code: int | None = None, last: int | None = None) -> ContainerView:
    v = ContainerView("c", "img", state=state)
    if code is not None:
        v.terminated = _term(code)
    if last is not None:
        v.last_terminated = _term(last)
    return v


@pytest.mark.parametrize(
    ("init", "containers", "policy", "terminal", "phase"),
    [
        ([], [_view("waiting")], "Always", False, "Pending"),
        ([_view("running")], [_view("waiting")], "Always", False, "Pending"),
        ([_view("waiting", last=1)], [_view("waiting")], "Always", False, "Pending"),  # init in back-off
        ([_view("terminated", 1)], [_view("waiting")], "Never", False, "Failed"),
        ([_view("terminated", 0)], [_view("running")], "Always", False, "Running"),
        ([], [_view("waiting", last=3)], "Always", False, "Running"),  # CrashLoopBackOff is Running
        ([], [_view("terminated", 0), _view("terminated", 0)], "Never", False, "Succeeded"),
        ([], [_view("terminated", 0), _view("terminated", 2)], "Never", False, "Failed"),
        ([], [_view("terminated", 0), _view("running")], "Never", False, "Running"),
        ([], [_view("terminated", 0)], "OnFailure", False, "Succeeded"),
        ([], [_view("terminated", 143)], "Always", True, "Failed"),  # deleted: no more restarts
        ([], [_view("terminated", 0)], "Always", True, "Succeeded"),
    ],
)
def test_pod_phase_follows_get_phase(
    init: list[ContainerView], containers: list[ContainerView], policy: str, terminal: bool, phase: str
) -> None:
    assert pod_phase(init, containers, policy, terminal) == phase


def _conds(conds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in conds}


def test_conditions_report_unready_containers_and_keep_transition_times() -> None:
    init = [ContainerView("install", "i", state="terminated", terminated=_term(0))]
    main = ContainerView("main", "m", state="running", started_at=1)
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2020-01-01T00:00:00Z"}
    first = pod_conditions(init, [main], phase="Running", sandbox_ready=True, now=1000, previous=[scheduled])
    c = _conds(first)
    assert [x["type"] for x in first] == [
        "PodReadyToStartContainers",
        "Initialized",
        "Ready",
        "ContainersReady",
        "PodScheduled",
    ]
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "ContainersNotReady"
    assert c["Ready"]["message"] == "containers with unready status: [main]"
    assert c["PodScheduled"] == scheduled
    main.ready = True
    second = _conds(
        pod_conditions(init, [main], phase="Running", sandbox_ready=True, now=2000, previous=first)
    )
    assert (
        second["Ready"]["status"] == "True"
        and second["Ready"]["lastTransitionTime"] == "1970-01-01T00:33:20Z"
    )
    assert second["Initialized"]["lastTransitionTime"] == "1970-01-01T00:16:40Z"  # unchanged: kept
    pending = _conds(
        pod_conditions([ContainerView("install", "i")], [main], phase="Pending", sandbox_ready=True, now=5)
    )
    assert pending["Initialized"]["message"] == "containers with incomplete status: [install]"
    done = _conds(pod_conditions([], [main], phase="Succeeded", sandbox_ready=True, now=5))
    assert (
        done["Ready"]["reason"] == "PodCompleted" and done["PodReadyToStartContainers"]["status"] == "False"
    )


def test_pod_status_has_the_kubelet_fields() -> None:
    main = ContainerView("main", "m", state="running", started_at=10)
    status = pod_status(
        init=[],
        containers=[main],
        restart_policy="Always",
        pod_ip="127.0.0.9",
        host_ip="127.0.0.1",
        start_time=5,
        now=11,
    )
    assert status["phase"] == "Running"
    assert status["podIP"] == "127.0.0.9" and status["podIPs"] == [{"ip": "127.0.0.9"}]
    assert status["hostIP"] == "127.0.0.1" and status["startTime"] == "1970-01-01T00:00:05Z"
    assert "initContainerStatuses" not in status
    assert status["containerStatuses"][0]["name"] == "main"


def test_termination_message_file_wins_and_logs_are_only_a_fallback_on_error() -> None:
    log = b"".join(f"line {i}\n".encode() for i in range(200))
    assert termination_message(b"from file", "FallbackToLogsOnError", 1, log) == "from file"
    assert termination_message(b"x" * 5000 + b"END", "File", 1, log).endswith("END")
    assert len(termination_message(b"x" * 5000, "File", 0).encode()) == 4096
    assert termination_message(b"", "File", 1, log) == ""
    assert termination_message(b"", "FallbackToLogsOnError", 0, log) == ""
    tail = termination_message(b"", "FallbackToLogsOnError", 1, log)
    assert tail.startswith("line 120\n") and tail.endswith("line 199\n")
    assert tail == log_tail(log)


def test_log_tail_keeps_the_last_80_lines_then_the_last_2048_bytes() -> None:
    long_lines = b"".join(b"%03d" % i + b"-" * 60 + b"\n" for i in range(100))
    tail = log_tail(long_lines)
    assert len(tail.encode()) == 2048
    assert tail.endswith("099" + "-" * 60 + "\n")
    assert log_tail(b"a\nb\nc", lines=2) == "b\nc"
    assert log_tail(b"\xff\xfeok\n") == "\ufffd\ufffdok\n"


def test_crash_loop_message_reads_like_the_kubelets() -> None:
    assert crash_loop_message(10, "main", "web-0", "ns", "u1") == (
        "back-off 10s restarting failed container=main pod=web-0_ns(u1)"
    )
    assert crash_loop_message(0.5, "c", "p", "n", "u").startswith("back-off 0.5s ")
    assert crash_loop_message(300, "c", "p", "n", "u").startswith("back-off 5m0s ")


def test_exit_reasons() -> None:
    assert exit_reason(0, False) == "Completed"
    assert exit_reason(3, False) == "Error"
    assert exit_reason(137, True) == "OOMKilled"
    assert exit_from_returncode(-9).exit_code == 137 and exit_from_returncode(-9).signal == 9
    assert exit_from_returncode(3).exit_code == 3 and exit_from_returncode(3).signal == 0


# ------------------------------------------------------------------------------ probes


def test_probe_parsing_uses_api_defaults_and_named_ports() -> None:
    container = {"ports": [{"name": "http", "containerPort": 8000}]}
    spec = parse_probe({"httpGet": {"port": "http", "path": "/health"}}, container)
    assert (spec.kind, spec.port, spec.path, spec.period, spec.timeout, spec.failure_threshold) == (
        "httpGet",
        8000,
        "/health",
        10.0,
        1.0,
        3,
    )
    assert parse_probe({"tcpSocket": {"port": 22}, "periodSeconds": 2}, container).period == 2.0
    with pytest.raises(SpecError, match="no port named"):
        parse_probe({"httpGet": {"port": "metrics"}}, container)


def test_probe_timer_waits_for_initial_delay_then_needs_thresholds_to_flip() -> None:
    spec = ProbeSpec(kind="httpGet", initial_delay=5, period=1, success_threshold=2, failure_threshold=3)
    readiness = ProbeTimer(spec, started_at=100, initial=False)
    assert not readiness.due(104.9) and readiness.due(105)
    assert readiness.record(True, 105) is False and readiness.result is False  # 1 of 2 successes
    assert not readiness.due(105.5)
    assert readiness.record(True, 106) is True and readiness.result is True
    assert readiness.record(False, 107) is False and readiness.record(False, 108) is False
    assert readiness.record(True, 109) is False  # a success resets the failure streak
    flips = [readiness.record(False, t) for t in (110, 111, 112)]
    assert flips == [False, False, True] and readiness.result is False and readiness.failed_out


@pytest.fixture
def http_server() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/ok" else 500)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_http_and_tcp_checks(http_server: int) -> None:
    assert check_http(ProbeSpec(kind="httpGet", port=http_server, path="/ok"), "127.0.0.1") == (True, "")
    ok, msg = check_http(ProbeSpec(kind="httpGet", port=http_server, path="/bad"), "127.0.0.1")
    assert not ok and "statuscode: 500" in msg
    assert check_tcp(ProbeSpec(kind="tcpSocket", port=http_server), "127.0.0.1")[0]
    closed = ProbeSpec(kind="tcpSocket", port=http_server, host="127.0.0.3")  # nothing listens there
    assert not check_tcp(closed, "127.0.0.1")[0]


# ------------------------------------------------------------------------------ processes and image


def test_container_pids_follow_the_marker_across_sessions() -> None:
    marker = f"test/{os.getpid()}/{time.monotonic_ns()}"
    # The child starts a grandchild in its own session: only the marker still finds it.
    code = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True);"
        "print(p.pid, flush=True); time.sleep(30)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, CONTAINER_ENV: marker},
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert parent.stdout is not None
        grandchild = int(parent.stdout.readline())
        assert sorted(container_pids(marker)) == sorted([parent.pid, grandchild])
        assert container_pids(marker + "-other") == []
    finally:
        for pid in container_pids(marker):
            os.kill(pid, signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 5
    while container_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert container_pids(marker) == []


def test_image_python_has_third_party_packages_but_not_rankguards(tmp_path: Path) -> None:
    table = build_image(tmp_path / "bin")
    assert set(table.commands) == {"python3", "python", "vllm", "rankguard-agent-install"}
    assert all(os.access(p, os.X_OK) for p in table.commands.values())
    probe = (
        "import importlib.util as u, yaml;"
        "print([u.find_spec(m) is None for m in ('rankguard_sim', 'rankguard_operator', 'rankguard_agent')])"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [table.commands["python3"], "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[True, True, True]"


def test_image_python_reports_the_snapshot_vllm_version_without_vllm_on_the_test_side(tmp_path: Path) -> None:
    """The agent reads importlib.metadata.version("vllm") in the vLLM container, never importing it."""
    from rankguard_sim.vllm_snapshot import version

    table = build_image(tmp_path / "bin")
    probe = (
        "import importlib.metadata as m, importlib.util as u;"
        "print(m.version('vllm'), u.find_spec('vllm') is None)"
    )
    out = subprocess.run(
        [table.commands["python3"], "-c", probe],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "pod")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert version() == "0.33.0"
    assert out.stdout.split() == ["0.33.0", "True"]  # the metadata only: there is no vllm to import
    # Nothing leaks into this (the test) process: no "vllm" distribution here.
    import importlib.metadata

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    assert not list((Path(__file__).resolve().parents[2] / "sim").rglob("vllm-*.dist-info"))


def test_agent_install_copies_the_package_that_then_imports_from_the_copy(tmp_path: Path) -> None:
    table = build_image(tmp_path / "bin")
    dest = tmp_path / "opt" / "agent"
    subprocess.run([table.commands["rankguard-agent-install"], str(dest)], capture_output=True, check=True)
    assert (dest / "rankguard_agent" / "__init__.py").is_file()
    assert not list(dest.rglob("__pycache__"))
    out = subprocess.run(
        [table.commands["python3"], "-c", "import rankguard_agent; print(rankguard_agent.__file__)"],
        env={"PYTHONPATH": str(dest)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == str(dest / "rankguard_agent" / "__init__.py")
    with pytest.raises(FileNotFoundError):
        install(tmp_path / "not-a-package", dest)


# ------------------------------------------------------------------------------ volumes


def test_volume_files_from_config_maps_secrets_downward_api_and_tokens() -> None:
    objects = {
        ("configmap", "ns1", "kube-root-ca.crt"): {"ca.crt": "CA"},
        ("secret", "ns1", "s"): {"a": "1", "b": "2"},
    }

    def lookup(kind: str, ns: str, name: str) -> dict[str, str] | None:
        return objects.get((kind, ns, name))

    def token(pod: Any, source: Any) -> str:
        return f"token-for-{pod['metadata']['name']}-{source.get('audience', 'api')}"

    projected = {
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]
                    }
                },
            ]
        }
    }
    assert volume_files(POD, projected, FACTS, lookup, token) == {
        "token": b"token-for-web-0-api",
        "ca.crt": b"CA",
        "namespace": b"ns1",
    }
    secret = {"secret": {"secretName": "s", "items": [{"key": "b", "path": "dir/b.txt"}]}}
    assert volume_files(POD, secret, FACTS, lookup, token) == {"dir/b.txt": b"2"}
    assert volume_files(POD, {"emptyDir": {}}, FACTS, lookup, token) == {}
    assert volume_files(POD, {"configMap": {"name": "missing", "optional": True}}, FACTS, lookup, token) == {}
    with pytest.raises(SpecError) as err:
        volume_files(POD, {"configMap": {"name": "missing"}}, FACTS, lookup, token)
    assert err.value.reason == "FailedMount"


# ------------------------------------------------------------------------------ watch (offline)


class _FakeWatchResponse:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self._body = b"".join(json.dumps(e).encode() + b"\n" for e in events)
        self.released = False

    def stream(self, amt: int | None = None, decode_content: bool = False) -> Iterator[bytes]:
        # Split mid-line: the kubelet must reassemble events across chunks.
        yield self._body[:7]
        yield self._body[7:]

    def release_conn(self) -> None:
        self.released = True


class _FakeCore:
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.response = _FakeWatchResponse(events)
        self.calls: list[dict[str, Any]] = []

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> _FakeWatchResponse:
        self.calls.append(kwargs)
        return self.response


def test_watch_follows_bookmarks_relists_on_410_and_raises_on_other_errors(tmp_path: Path) -> None:
    from kubernetes import client

    kubelet = ProcessKubelet(client.ApiClient(), "n1", workdir=tmp_path / "w", gpu_root=tmp_path / "g")
    try:
        bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "42"}}}
        core = _FakeCore([bookmark])
        assert kubelet._watch_once(core, "spec.nodeName=n1", "7") == "42"
        call = core.calls[0]
        assert call["watch"] is True and call["resource_version"] == "7"
        assert call["field_selector"] == "spec.nodeName=n1" and call["allow_watch_bookmarks"] is True
        assert core.response.released
        expired = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
        assert kubelet._watch_once(_FakeCore([bookmark, expired]), "s", "7") is None
        broken = {"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "etcd down"}}
        with pytest.raises(RuntimeError, match="etcd down"):
            kubelet._watch_once(_FakeCore([broken]), "s", "7")
    finally:
        kubelet.stop()
