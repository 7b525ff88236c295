"""`python -m rankguard_sim ...`: the sandbox world for people.

python -m rankguard_sim cluster up     # start a control plane, print KUBECONFIG, wait
python -m rankguard_sim cluster down   # stop the one started by `cluster up`
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rankguard_sim.kube.cluster import ControlPlane, ControlPlaneError
from rankguard_sim.kube.testbin import TestbinMissing

DEFAULT_DIR = Path(os.environ.get("RANKGUARD_CLUSTER_DIR", Path.home() / ".cache" / "rankguard" / "cluster"))


def _state_file(folder: Path) -> Path:
    return folder / "state.json"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_signal(on_ready: Callable[[], None] | None = None) -> None:
    """Block the main thread until SIGINT or SIGTERM."""
    stop = threading.Event()

    def _handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    if on_ready:
        on_ready()
    while not stop.wait(0.5):
        pass


def cluster_up(folder: Path) -> int:
    state = _state_file(folder)
    if state.exists():
        old = json.loads(state.read_text())
        if _pid_alive(int(old.get("pid", 0))):
            print(f"a control plane is already running (pid {old['pid']}); KUBECONFIG={old['kubeconfig']}")
            print("stop it with: python -m rankguard_sim cluster down")
            return 1
    folder.mkdir(parents=True, exist_ok=True)
    # A fresh PKI every time, so an old etcd (signed by the old keys) must go too.
    shutil.rmtree(folder / "run", ignore_errors=True)
    started = time.monotonic()
    try:
        cp = ControlPlane.start(folder / "run")
    except (TestbinMissing, ControlPlaneError) as e:
        print(f"cluster up failed: {e}", file=sys.stderr)
        return 1
    try:
        state.write_text(
            json.dumps({"pid": os.getpid(), "kubeconfig": str(cp.kubeconfig), "bin": str(cp.bin)})
        )

        def ready() -> None:
            print(f"control plane ready in {time.monotonic() - started:.1f}s at {cp.server}")
            print(f"export KUBECONFIG={cp.kubeconfig}")
            print(f"export PATH={cp.bin}:$PATH   # kubectl {cp.bin / 'kubectl'} matches the server version")
            print("logs:", cp.logs)
            print("Ctrl-C (or `python -m rankguard_sim cluster down`) stops it.", flush=True)

        wait_for_signal(ready)
    finally:
        cp.stop()
        with contextlib.suppress(FileNotFoundError):
            state.unlink()
    print("control plane stopped")
    return 0


def cluster_down(folder: Path, timeout: float = 30.0) -> int:
    state = _state_file(folder)
    if not state.exists():
        print("no control plane is running (nothing to stop)")
        return 0
    pid = int(json.loads(state.read_text()).get("pid", 0))
    if pid and _pid_alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)  # its components die with it (parent-death signal)
    with contextlib.suppress(FileNotFoundError):
        state.unlink()
    print("control plane stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rankguard_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cluster", help="a local control plane")
    c.add_argument("action", choices=["up", "down"])
    c.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"state folder (default {DEFAULT_DIR})")
    d = sub.add_parser("demo", help="the narrated local demo")
    d.add_argument("action", choices=["up", "down"])
    d.add_argument("--keep", action="store_true", help="keep everything running after the demo")
    args = parser.parse_args(argv)
    if args.cmd == "cluster":
        return cluster_up(args.dir) if args.action == "up" else cluster_down(args.dir)
    from rankguard_sim import demo  # noqa: PLC0415 - pulls in the kubelet and the scenarios

    return demo.up(keep=args.keep) if args.action == "up" else demo.down()


if __name__ == "__main__":
    sys.exit(main())
