"""The pod status the process kubelet writes: container states, phase, conditions, the
termination message, the CrashLoopBackOff message and exit reasons.

The operator reads this status exactly as it reads a real kubelet's, so each field follows
the kubelet's own rules (getPhase, condition transition times, a termination message of at
most 4096 bytes, a log tail of the last 80 lines or 2048 bytes).
"""

from __future__ import annotations

from typing import Any

import pytest

from rankguard_sim.kubelet.pod.proc import exit_from_returncode
from rankguard_sim.kubelet.pod.status import (
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
