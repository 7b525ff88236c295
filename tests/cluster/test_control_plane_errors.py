"""Bad input to the control plane runner gives one clear error and leaves nothing behind."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from rankguard_sim.kube.cluster import ControlPlane, ControlPlaneError

pytestmark = pytest.mark.cluster


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_port_clash_is_one_clear_error_and_nothing_is_left_running(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
        with pytest.raises(ControlPlaneError, match=rf"port {port} on 127.0.0.1 is already in use"):
            ControlPlane.start(tmp_path, timeout=30, apiserver_port=port)
    after = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    leftovers = []
    for pid in after - before:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"etcd" in cmd or b"kube-" in cmd:
            leftovers.append(pid)
    assert [p for p in leftovers if _alive(p)] == []


def test_stop_leaves_no_process_and_frees_the_port(tmp_path: Path) -> None:
    cp = ControlPlane.start(tmp_path)
    pids = cp.pids()
    assert len(pids) == 4  # etcd, apiserver, controller-manager, scheduler
    port = cp.apiserver_port
    cp.stop()
    assert [p for p in pids if _alive(p)] == []
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # raises if the apiserver still held it
