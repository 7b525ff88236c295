"""Runs the built images: the checks of the CI image step (hack/images/ci-check.sh).

    .venv/bin/python hack/images/check_images.py --operator rankguard/operator:dev \
        --agent rankguard/agent:dev --python-base rankguard-local/python-base:bookworm

1. The operator image: `--version` answers, the agent CLI inside it answers `--version`, it
   holds neither the sandbox (rankguard_sim) nor test tools, and it runs as 65532:65532.
2. The operator image against a real control plane (rankguard_sim.kube.cluster.ControlPlane, the
   binaries of hack/testbin): host network, a kubeconfig mounted read-only, the CRD installed.
   After `kubectl apply -f examples/llama3-70b-tp4.yaml` the API server must hold the
   Deployment the operator rendered (its init container from RANKGUARD_AGENT_IMAGE) and the
   LLMService a status with a phase. No kubelet runs, so the pods stay Pending; that is enough.
   /healthz and /metrics must answer on the ports given.
3. The agent image installs its bundle into a mounted folder (as the init container does into
   the emptyDir), and `rankguard-agent launch -- CHILD` from that folder runs the child and
   exits with its code, on two Pythons: the python base image's own `python3` (no aiohttp:
   the entry's fallback path, which runs the engine without the agent, and says so) and the
   repository's virtualenv (aiohttp, prometheus_client, PyYAML: the full agent path).

Each check prints PASS or FAIL with its reason; on a failure of 2 the operator container's
log is printed. The exit status is 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from rankguard_sim.kube.cluster import ControlPlane, free_port
from rankguard_sim.waiting import wait_for
from rankguard_sim.world import install_crd, llmservice

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "llama3-70b-tp4.yaml"
NAMESPACE = "default"
IMAGE_USER = "65532:65532"
VERSION = importlib.metadata.version("rankguard")  # the editable install of this checkout
CHILD = ["python3", "-c", "print('child ran'); raise SystemExit(7)"]


class CheckFailed(Exception):
    """One check did not hold; the message says what was seen."""


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [os.environ.get("DOCKER", "docker"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


def wait(
    what: str, probe: Callable[[], Any], timeout: float, alive: Callable[[], None] = lambda: None
) -> Any:
    """`probe()` until it is truthy (its errors count as not yet), through the sandbox's one
    wait loop; `alive()` raises CheckFailed when waiting longer is pointless."""

    def attempt() -> Any:
        with contextlib.suppress(Exception):
            found = probe()
            if found:
                return found
        alive()
        return None

    try:
        return wait_for(what, attempt, timeout, every=1)
    except AssertionError:
        raise CheckFailed(f"{what}: not within {timeout:.0f} s") from None


def running(container: str) -> Callable[[], None]:
    def check() -> None:
        state = docker("inspect", "--format", "{{.State.Running}} {{.State.ExitCode}}", container)
        up, _, code = state.stdout.strip().partition(" ")
        if up != "true":
            raise CheckFailed(f"the container {container} is not running (exit code {code or '?'})")

    return check


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return int(r.status), r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")


# --------------------------------------------------------------------------- 1. contents
def check_operator_contents(operator: str) -> str:
    r = docker("run", "--rm", operator, "--version")
    expect(r.returncode == 0, f"`{operator} --version` exited {r.returncode}: {r.stderr.strip()}")
    expect(r.stdout.strip() == f"python -m rankguard_operator {VERSION}", f"--version said {r.stdout!r}")
    # One container for the rest: each start copies the whole image on a vfs engine (~15 s).
    absent = ("rankguard_sim", "pytest", "hypothesis", "torch", "mypy", "pip")
    probe = f"import importlib.util as u; print([m for m in {absent!r} if u.find_spec(m)])"
    script = f'python -m rankguard_agent --version && python -c "{probe}"'
    r = docker("run", "--rm", "--entrypoint", "sh", operator, "-c", script)
    lines = r.stdout.split()
    expect(
        r.returncode == 0 and lines[:1] == [VERSION],
        f"the agent's --version said {r.stdout!r} {r.stderr[-300:]!r}",
    )
    expect(lines[1:] == ["[]"], f"the image holds what it should not: {lines[1:]} {r.stderr[-300:]}")
    user = docker("image", "inspect", "--format", "{{.Config.User}}", operator).stdout.strip()
    expect(user == IMAGE_USER, f"the image runs as {user!r}, not {IMAGE_USER}")
    return f"--version {VERSION} (operator and agent CLIs), no rankguard_sim/test tools/pip, user {user}"


# --------------------------------------------------------------------------- 2. operator
def container_kubeconfig(cp: ControlPlane, path: Path) -> Path:
    """The admin kubeconfig with its certificates inline, readable by the image's user only."""
    cfg = yaml.safe_load(cp.kubeconfig.read_text())
    cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
    for key, file_key in (
        ("certificate-authority-data", "certificate-authority"),
        ("client-certificate-data", "client-certificate"),
        ("client-key-data", "client-key"),
    ):
        holder = cluster if file_key in cluster else user
        holder[key] = base64.b64encode(Path(holder.pop(file_key)).read_bytes()).decode()
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)
    if os.geteuid() == 0:
        uid, gid = (int(x) for x in IMAGE_USER.split(":"))
        os.chown(path, uid, gid)
    else:  # a rootless engine maps users otherwise; a throwaway cluster's key, removed after
        path.chmod(0o644)
    return path


def owned_deployments(api: client.ApiClient, name: str) -> list[Any]:
    items = client.AppsV1Api(api).list_namespaced_deployment(NAMESPACE).items
    return [
        d
        for d in items
        if any(o.kind == "LLMService" and o.name == name for o in d.metadata.owner_references or [])
    ]


@contextlib.contextmanager
def operator_container(
    operator: str, agent: str, kubeconfig: Path, liveness: int, metrics: int
) -> Iterator[str]:
    name = f"rankguard-ci-operator-{uuid.uuid4().hex[:8]}"
    r = docker(
        "run",
        "--detach",
        "--name",
        name,
        "--network",
        "host",
        "--volume",
        f"{kubeconfig}:/etc/rankguard/kubeconfig:ro",
        "--env",
        "KUBECONFIG=/etc/rankguard/kubeconfig",
        "--env",
        f"RANKGUARD_LIVENESS_PORT={liveness}",
        "--env",
        f"RANKGUARD_METRICS_PORT={metrics}",
        "--env",
        f"RANKGUARD_AGENT_IMAGE={agent}",
        operator,
    )
    expect(r.returncode == 0, f"docker run {operator} failed: {r.stderr.strip()}")
    try:
        yield name
    finally:
        docker("rm", "--force", name, timeout=60)


def check_operator_runs(operator: str, agent: str, work: Path) -> str:
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        cp = ControlPlane.start(work / "control-plane", storage=False)
        stack.callback(cp.stop)
        install_crd(cp)
        api = stack.enter_context(contextlib.closing(cp.api_client()))
        kubeconfig = container_kubeconfig(cp, work / "kubeconfig")
        liveness, metrics = free_port(), free_port()
        with operator_container(operator, agent, kubeconfig, liveness, metrics) as name:
            try:
                wait(
                    f"the operator's /healthz on :{liveness}",
                    lambda: http_get(f"http://127.0.0.1:{liveness}/healthz")[0] == 200,
                    120,
                    running(name),
                )
                service = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
                cp.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLE))
                deployment = wait(
                    f"a Deployment owned by LLMService {service}",
                    lambda: owned_deployments(api, service),
                    120,
                    running(name),
                )[0]
                phase = wait(
                    f"LLMService {service} with status.phase",
                    lambda: (llmservice(api, NAMESPACE, service).get("status") or {}).get("phase"),
                    120,
                    running(name),
                )
                inits = [c.image for c in deployment.spec.template.spec.init_containers or []]
                expect(agent in inits, f"the Deployment's init containers run {inits}, not {agent}")
                code, body = http_get(f"http://127.0.0.1:{metrics}/metrics")
                expect(code == 200 and "rankguard_" in body, f"/metrics on :{metrics} answered {code}")
            except (CheckFailed, subprocess.CalledProcessError) as e:
                logs = docker("logs", "--tail", "80", name)
                print(f"--- the operator container's log (last 80 lines):\n{logs.stdout}{logs.stderr}---")
                raise CheckFailed(str(e)) from None
    return (
        f"Deployment {deployment.metadata.name} rendered, LLMService phase {phase}, "
        f"/healthz and /metrics answer ({time.monotonic() - started:.0f} s with the control plane)"
    )


# --------------------------------------------------------------------------- 3. agent
def install_bundle(agent: str, dest: Path) -> None:
    dest.mkdir()
    if os.geteuid() == 0:
        uid, gid = (int(x) for x in IMAGE_USER.split(":"))
        os.chown(dest, uid, gid)
    else:
        dest.chmod(0o777)
    r = docker("run", "--rm", "--volume", f"{dest}:/opt/rankguard/agent", agent)
    expect(r.returncode == 0, f"the agent image exited {r.returncode}: {r.stderr.strip()}")
    expect("agent bundle copied into /opt/rankguard/agent" in r.stdout, f"it said {r.stdout!r}")
    for path in ("rankguard-agent", "rankguard_agent/launcher.py", "pynvml.py"):
        expect((dest / path).is_file(), f"the bundle has no {path}")
    for path in ("example.py", "bin"):
        expect(not (dest / path).exists(), f"the bundle holds {path}")


def check_launch(result: subprocess.CompletedProcess[str], full: bool) -> None:
    expect(
        result.returncode == 7,
        f"launch exited {result.returncode}, not the child's 7: {result.stderr[-800:]}",
    )
    expect("child ran" in result.stdout, f"the child's output is missing: {result.stdout!r}")
    fell_back = "running the engine without rankguard" in result.stderr
    if full:
        expect(not fell_back, f"the full agent did not start: {result.stderr[-800:]}")
        expect(
            "engine exited with 7" in result.stderr,
            f"the agent did not report the exit: {result.stderr[-800:]}",
        )
    else:
        expect(fell_back, f"expected the entry's fallback (no aiohttp there): {result.stderr[-800:]}")


def check_agent(agent: str, python_base: str, work: Path) -> str:
    bundle = work / "agent"
    install_bundle(agent, bundle)
    # The base image's own python3, as a vLLM image without aiohttp would run it.
    base = docker(
        "run",
        "--rm",
        "--network",
        "host",
        "--user",
        IMAGE_USER,
        "--env",
        "PYTHONDONTWRITEBYTECODE=1",
        "--volume",
        f"{bundle}:/opt/rankguard/agent:ro",
        python_base,
        "python3",
        "/opt/rankguard/agent/rankguard-agent",
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--",
        *CHILD,
    )
    check_launch(base, full=False)
    # The repository's Python: aiohttp, prometheus_client and PyYAML, like a vLLM image.
    full = subprocess.run(
        [
            sys.executable,
            str(bundle / "rankguard-agent"),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--termination-log",
            str(work / "termination-log"),
            "--",
            *CHILD,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"),
    )
    check_launch(full, full=True)
    return (
        f"bundle installed; launch ran the child and exited 7 under {python_base}'s python3 "
        f"(fallback path: no aiohttp there) and under {sys.executable} (full agent path)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--operator", required=True, help="the operator image")
    parser.add_argument("--agent", required=True, help="the agent image")
    parser.add_argument("--python-base", required=True, help="an image with python3 (the build's base)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rankguard-images-"))
    checks: list[tuple[str, Callable[[], str]]] = [
        ("operator image contents", lambda: check_operator_contents(args.operator)),
        (
            "operator image against a control plane",
            lambda: check_operator_runs(args.operator, args.agent, work),
        ),
        ("agent image: install and launch", lambda: check_agent(args.agent, args.python_base, work)),
    ]
    failed = 0
    try:
        for what, check in checks:
            try:
                print(f"PASS {what}: {check()}", flush=True)
            except CheckFailed as e:
                failed += 1
                print(f"FAIL {what}: {e}", flush=True)
            except Exception as e:  # the control plane, docker or the API: say which, go on
                failed += 1
                print(f"FAIL {what}: {type(e).__name__}: {e}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
