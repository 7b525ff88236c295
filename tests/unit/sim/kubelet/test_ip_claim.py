"""Two sandboxes in one network namespace hand out the same pod IPs: the second one to start
says so, with what to do, before it runs anything (rankguard_sim.kubelet.ip_claim)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankguard_sim.kubelet import ip_claim
from rankguard_sim.kubelet.pod.spec import IpPool

# Far from the pool the tests' own kubelets draw from (127.0.0.2 on): a test run beside
# this one must not see its claim.
FIRST = 251
HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def proc_net(tmp_path: Path, *lines: str) -> Path:
    (tmp_path / "tcp").write_text(HEADER + "".join(f"{line}\n" for line in lines))
    (tmp_path / "tcp6").write_text(HEADER)
    return tmp_path


def test_a_second_sandbox_in_the_namespace_is_refused_until_the_first_lets_go(tmp_path: Path) -> None:
    empty = proc_net(tmp_path)
    mine, theirs = IpPool(first=FIRST, last=FIRST + 1), IpPool(first=FIRST, last=FIRST + 1)
    first = ip_claim.claim(mine, empty)
    second = ip_claim.claim(mine, empty)  # a second kubelet of the same sandbox shares it
    try:
        with pytest.raises(ip_claim.SandboxCollision) as refused:
            ip_claim.claim(theirs, empty)
        message = str(refused.value)
        assert f"first pod IP 127.0.0.{FIRST} is not free" in message
        assert "another sandbox holds its claim" in message
        assert "unshare --net --map-root-user" in message
        first.release()
        first.release()  # once: a kubelet stopped twice gives back one share
        with pytest.raises(ip_claim.SandboxCollision):  # one of its kubelets still runs
            ip_claim.claim(theirs, empty)
    finally:
        first.release()
        second.release()
    ip_claim.claim(theirs, empty).release()  # both stopped: the address is free


def test_a_process_left_listening_on_the_first_pod_ip_is_named(tmp_path: Path) -> None:
    # 127.0.0.251:8000 listening (0A), and a connection (01) on another port that is not
    listening = f"   0: {FIRST:02X}00007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 1"
    connected = f"   1: {FIRST:02X}00007F:2382 0100007F:1F40 01 00000000:00000000 00:00000000 00000000 0 0 2"
    table = proc_net(tmp_path, listening, connected)
    assert ip_claim.listeners(f"127.0.0.{FIRST}", table) == [8000]
    with pytest.raises(ip_claim.SandboxCollision, match=r"something already listens on port\(s\) \[8000\]"):
        ip_claim.claim(IpPool(first=FIRST, last=FIRST), table)
    assert ip_claim.listeners("127.0.0.9", table) == []
    assert ip_claim.listeners("127.0.0.9", tmp_path / "missing") == []
