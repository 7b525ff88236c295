"""`make demo`: the whole product on this machine, narrated.

A real control plane, a simulated 8-GPU node (the process kubelet) running the real agent and
the fake vLLM, and the operator as its own process. It applies examples/llama3-70b-tp4.yaml
(vLLM's default utilisation on every rank), shows `kubectl get llmservice -w` while rank 0 runs
out of memory and rankguard fixes it, prints the per-rank headroom, and then stops everything.
`make demo-down` stops whatever an interrupted demo left behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

from kubernetes import client

from rankguard_sim.kube.cluster import ControlPlane
from rankguard_sim.kube.testbin import REPO_ROOT
from rankguard_sim.world import OperatorProcess, install_crd, llmservice, start_node, wait_node_schedulable

DEMO_DIR = Path(os.environ.get("RANKGUARD_DEMO_DIR", REPO_ROOT / ".demo"))
EXAMPLE = REPO_ROOT / "examples" / "llama3-70b-tp4.yaml"
DEMO_ENV = "RANKGUARD_DEMO_ID"  # marks every process the demo starts, for `demo down`
NAMESPACE = "default"
NAME = "llama3-70b"
TIMEOUT = 300.0


def say(text: str = "") -> None:
    print(text, flush=True)


def _state() -> Path:
    return DEMO_DIR / "state.json"


def _remediated_and_ready(svc: dict[str, Any]) -> bool:
    st = svc.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    oom = any(r.get("trigger") == "CUDAOutOfMemory" for r in st.get("remediations") or [])
    return ready and oom and bool(st.get("minHeadroom"))


class EventPrinter(threading.Thread):
    """Prints the LLMService's Events as they arrive, so the table's changes have reasons."""

    def __init__(self, api: Any) -> None:
        super().__init__(daemon=True)
        self.api, self.stop = api, threading.Event()
        self.seen: set[str] = set()

    def run(self) -> None:
        core = client.CoreV1Api(self.api)
        while not self.stop.wait(1.0):
            with contextlib.suppress(Exception):
                items = core.list_namespaced_event(
                    NAMESPACE, field_selector=f"involvedObject.kind=LLMService,involvedObject.name={NAME}"
                ).items
                for e in sorted(items, key=lambda e: str(e.metadata.creation_timestamp)):
                    if e.metadata.uid in self.seen:
                        continue
                    self.seen.add(e.metadata.uid)
                    say(f"  event  {e.type:<7} {e.reason}: {e.message}")


class ChangedRows(threading.Thread):
    """Passes `kubectl get -w` through, each row only when it shows something new.

    Every write to the service is a watch event, and most change nothing the table shows (an
    agent's scrape time, a heartbeat), yet kubectl prints the row again each time. A row is
    printed when its columns, AGE aside, differ from the last row printed for that name.
    """

    def __init__(self, rows: IO[str]) -> None:
        super().__init__(daemon=True)
        self.rows = rows
        self.shown: dict[str, list[str]] = {}

    def fresh(self, line: str) -> bool:
        """Whether `line` differs from the last one shown for its name (AGE, the last column,
        aside), remembering it if so. The header is shown once."""
        cells = line.split()
        if not cells:
            return False
        name, rest = cells[0], cells[1:-1]
        if self.shown.get(name) == rest:
            return False
        self.shown[name] = rest
        return True

    def run(self) -> None:
        for line in self.rows:
            if self.fresh(line):
                say(line.rstrip("\n"))


def _summary(svc: dict[str, Any]) -> None:
    st = svc.get("status") or {}
    say("\nPer-rank headroom (the lowest free memory each rank reported over the agent's window):")
    say(f"  {'RANK':<5} {'TOTAL':>8} {'FREE':>8} {'MIN FREE':>9}")
    for r in st.get("ranks") or []:
        say(
            f"  {r['rank']:<5} {r['totalBytes'] / 2**30:>7.1f}G {r['freeBytes'] / 2**30:>7.2f}G"
            f" {r['minFreeBytes'] / 2**30:>8.2f}G"
        )
    say(f"\nBottleneck: {st.get('bottleneck')}; KV budget now: {st.get('kvBudget')} per GPU.")
    say("What rankguard did:")
    for h in st.get("remediations") or []:
        say(f"  {h.get('time')} {h.get('action')} ({h.get('trigger')}): {h.get('message')}")


def up(keep: bool = False) -> int:
    if _state().exists():
        old = json.loads(_state().read_text())
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(int(old.get("pid", 0)), 0)
            say(f"a demo is already running (pid {old['pid']}); stop it with `make demo-down`")
            return 1
    DEMO_DIR.mkdir(parents=True, exist_ok=True)
    demo_id = uuid.uuid4().hex[:12]
    _state().write_text(json.dumps({"pid": os.getpid(), "id": demo_id}))
    started = time.monotonic()
    cp = node = op = watcher = printer = None
    code = 1

    def stop_on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_signal)
    # The kubelet's and clients' own logs go to a file: the terminal is for the story.
    handler = logging.FileHandler(DEMO_DIR / "sandbox.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    try:
        say("rankguard demo: a real Kubernetes control plane, one simulated node with 8 GPUs")
        say("(A100 80 GB, from sim/rankguard_sim/scenarios/llama3-70b-tp4.yaml), the rankguard")
        say("operator, and the rankguard agent inside each vLLM pod. Nothing leaves this machine.\n")
        cp = ControlPlane.start(DEMO_DIR / "control-plane")
        install_crd(cp)
        api = cp.api_client()
        node = start_node(
            api,
            DEMO_DIR / "nodes",
            "gpu-node-0",
            "llama3-70b-tp4",
            time_scale=2,
            backoff_base=1,
            backoff_cap=5,
        )
        node.kubelet.extra_env[DEMO_ENV] = demo_id
        wait_node_schedulable(api, node.name)
        op = OperatorProcess(cp.kubeconfig, DEMO_DIR / "operator.log", env_extra={DEMO_ENV: demo_id})
        op.start()
        op.wait_ready()
        say(f"control plane, node and operator up in {time.monotonic() - started:.0f}s")
        say(f"  export KUBECONFIG={cp.kubeconfig}   # to look around from another terminal")
        say(f"  operator log: {op.log}; kubelet log: {DEMO_DIR / 'sandbox.log'}\n")

        say(f"$ kubectl apply -f {EXAMPLE.relative_to(REPO_ROOT)}")
        say(cp.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE)).stdout.strip())
        say(
            "\nThe service starts at vLLM's default --gpu-memory-utilization 0.92 on every rank. vLLM\n"
            "0.33's workers are identical and every rank all-gathers the logits, but GPU 0 also holds\n"
            "the CUDA contexts of the container's API server and engine core (1.5 GiB vLLM's budget\n"
            "never sees), so rank 0 has the least headroom and runs out first as the batch grows.\n"
            "Watch the table: the agent reports the CUDA OOM, rankguard sets an explicit per-GPU KV\n"
            "budget from the bottleneck rank, and the service comes back Ready with headroom on\n"
            "every rank.\n"
        )
        say(f"$ kubectl get llmservice {NAME} -w")
        watcher = subprocess.Popen(
            [
                str(cp.kubectl_path),
                f"--kubeconfig={cp.kubeconfig}",
                "get",
                "llmservice",
                NAME,
                "-n",
                NAMESPACE,
                "-w",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert watcher.stdout is not None
        rows = ChangedRows(watcher.stdout)
        rows.start()
        printer = EventPrinter(api)
        printer.start()
        deadline = time.monotonic() + TIMEOUT
        svc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            svc = llmservice(api, NAMESPACE, NAME)
            if _remediated_and_ready(svc):
                break
            time.sleep(1)
        else:
            say(f"\nThe service did not settle within {TIMEOUT:.0f}s; see {op.log} and `kubectl describe`.")
            return 1
        time.sleep(6)  # a few more lines of live headroom in the table
        watcher.terminate()
        printer.stop.set()
        rows.join(timeout=5)  # the table's last rows before the summary
        # The summary tells the settled story: the latest status if it still does (on a busy
        # machine a scrape can time out and leave the ranks stale for a moment), else the one
        # that ended the wait.
        latest = llmservice(api, NAMESPACE, NAME)
        _summary(latest if _remediated_and_ready(latest) else svc)
        say(f"\nDone in {time.monotonic() - started:.0f}s.")
        if keep:
            say("Everything keeps running until Ctrl-C (or `make demo-down`).")
            while True:
                time.sleep(1)
        code = 0
    except KeyboardInterrupt:
        say("\ninterrupted")
        code = 130
    finally:
        say("stopping the operator, the node's pods, and the control plane...")
        if watcher is not None and watcher.poll() is None:
            watcher.terminate()
        if printer is not None:
            printer.stop.set()
        if op is not None:
            op.stop()
        if node is not None:
            node.stop()
        if cp is not None:
            cp.stop()
        left = _demo_processes(json.loads(_state().read_text()).get("id", "")) if _state().exists() else []
        _kill(left)
        with contextlib.suppress(FileNotFoundError):
            _state().unlink()
        say("nothing left running.")
    return code


def _demo_processes(demo_id: str) -> list[int]:
    """Processes the demo started (they carry its id in their environment), this one excepted."""
    found: list[int] = []
    if not demo_id:
        return found
    needle = f"{DEMO_ENV}={demo_id}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
    return found


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def down() -> int:
    if not _state().exists():
        say("no demo is running")
        return 0
    state = json.loads(_state().read_text())
    pid = int(state.get("pid", 0))
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            os.kill(pid, 0)
            time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)  # its control plane and operator die with it
    _kill(_demo_processes(str(state.get("id", ""))))
    with contextlib.suppress(FileNotFoundError):
        _state().unlink()
    say("demo stopped; nothing left running")
    return 0
