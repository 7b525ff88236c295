"""Two sandboxes in one network namespace collide: each process's pool of loopback pod IPs
starts at 127.0.0.2 (kubelet.POD_IPS), so the first pod of one and the first pod of the
other get the same address, bind the same ports there (EADDRINUSE), or, worse, one sandbox's
operator scrapes the other's agent. A real cluster gives each pod a network namespace; the
sandbox gives each pod an address, and only one sandbox per network namespace can do that.

So a kubelet, before it runs anything, claims its pool's first pod IP for the process: it
listens on `CLAIM_PORT` at that address while any kubelet of the process that draws from the
pool runs (the last one to stop lets go: a test session runs sandboxes one after another,
and `make demo` beside it), and fails with what to do when that address is taken: another
sandbox's claim, or anything else already listening there (a process left from a sandbox
that was killed). Linux's /proc/net/tcp lists the listeners; elsewhere only the claim is
checked.
"""

from __future__ import annotations

import errno
import socket
import threading
from pathlib import Path

from rankguard_sim.kubelet.pod.spec import IpPool

# Far above the ports pods listen on (8000, the agent's 9090, rendezvous ports): the claim's own.
CLAIM_PORT = 64999
_LISTEN = "0A"  # /proc/net/tcp's state column for a listening socket
_held: dict[int, tuple[socket.socket, int]] = {}  # id(pool) -> its claim, the kubelets holding it
_lock = threading.Lock()


class SandboxCollision(RuntimeError):
    """The pod IPs are in use by another sandbox (or a leftover process) in this namespace."""


def _hex_v4(ip: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (little-endian hex)."""
    return "".join(f"{int(octet):02X}" for octet in reversed(ip.split(".")))


def listeners(ip: str, proc_net: Path = Path("/proc/net")) -> list[int]:
    """The ports something listens on at `ip` (IPv4, or IPv4-mapped IPv6), as /proc/net says;
    [] where it cannot be read (not Linux)."""
    v4 = _hex_v4(ip)
    wanted = {v4, f"0000000000000000FFFF0000{v4}"}
    ports: list[int] = []
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc_net / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 4 or fields[3] != _LISTEN:
                continue
            address, _, port = fields[1].partition(":")
            if address in wanted:
                ports.append(int(port, 16))
    return sorted(set(ports))


def _advice(ip: str, what: str) -> str:
    return (
        f"the sandbox's first pod IP {ip} is not free: {what}. Two sandboxes (two test runs, a "
        f"demo and a test run) in one network namespace hand out the same pod IPs and collide. "
        f"Run each in a network namespace of its own, e.g. "
        f"`unshare --net --map-root-user bash -c 'ip link set lo up && <command>'`, or stop the "
        f"other sandbox (and any process it left behind listening on {ip})"
    )


class Claim:
    """One kubelet's share of its pool's claim; `release` gives it back (once, whatever calls)."""

    def __init__(self, pool: IpPool | None) -> None:
        self._pool = pool

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            _release(pool)


UNCLAIMED = Claim(None)  # what a kubelet holds before it starts and after it stops


def claim(pool: IpPool, proc_net: Path = Path("/proc/net")) -> Claim:
    """Claim `pool`'s first pod IP for one more kubelet of this process (the first one binds);
    SandboxCollision if another sandbox has it."""
    with _lock:
        if id(pool) in _held:
            sock, holders = _held[id(pool)]
            _held[id(pool)] = (sock, holders + 1)
            return Claim(pool)
        ip = pool.first
        taken = [p for p in listeners(ip, proc_net) if p != CLAIM_PORT]
        if taken:
            raise SandboxCollision(_advice(ip, f"something already listens on port(s) {taken} there"))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((ip, CLAIM_PORT))
            sock.listen(1)
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE:
                raise SandboxCollision(
                    _advice(ip, f"another sandbox holds its claim ({ip}:{CLAIM_PORT} is in use)")
                ) from None
            raise
        sock.set_inheritable(False)  # the containers this process starts must not hold it
        _held[id(pool)] = (sock, 1)
    return Claim(pool)


def _release(pool: IpPool) -> None:
    """One kubelet's claim given back; the last one closes the socket."""
    with _lock:
        held = _held.pop(id(pool), None)
        if held is None:
            return
        sock, holders = held
        if holders > 1:
            _held[id(pool)] = (sock, holders - 1)
        else:
            sock.close()
