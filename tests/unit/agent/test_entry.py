"""Across modules: the bundle's entry `rankguard-agent`: the agent never takes serving down.

Every test runs the real entry from a bundle the sandbox's install stand-in made, as the
serving container would (`python3 <bundle>/rankguard-agent launch … -- ENGINE`). The agent
is made unable to start for real: `python -S` has no site-packages, so aiohttp is missing;
the sandbox's RANKGUARD_SIM_AGENT_BUNDLE=broken leaves server.py out of the package.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rankguard_agent import __version__
from rankguard_agent.launcher import engine_env
from rankguard_sim.kube.cluster import free_port
from rankguard_sim.kubelet.agent_install import BUNDLE_ENV, ENTRY
from rankguard_sim.kubelet.image import AGENT_ENTRY, build_image
from rankguard_sim.kubelet.kubelet import ProcessKubelet
from rankguard_sim.waiting import wait_for
from tests import REPO

# The engine: says what it inherited, then exits 3 (any code the entry must pass on).
ENGINE = """
import importlib.util, json, os, sys
def origin(name):
    spec = importlib.util.find_spec(name)
    return spec.origin if spec is not None else None
print(json.dumps({"PYTHONPATH": os.environ.get("PYTHONPATH"),
                  "rankguard_agent": origin("rankguard_agent"), "pynvml": origin("pynvml")}))
sys.exit(3)
"""


def make_bundle(tmp_path: Path, fault: str | None = None) -> Path:
    """A bundle as the sandbox's init container makes it (`rankguard-agent-install DEST`)."""
    table = build_image(tmp_path / "image")  # the stand-ins of image_python3 too
    dest = tmp_path / "bundle"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if fault is not None:
        env[BUNDLE_ENV] = fault
    subprocess.run(
        [table.commands["rankguard-agent-install"], str(dest)], env=env, capture_output=True, check=True
    )
    assert (dest / ENTRY).is_file() and (dest / "rankguard_agent" / "__init__.py").is_file()
    return dest


def image_python3(tmp_path: Path) -> str:
    """The sandbox image's python3 (after make_bundle): aiohttp and the rest, no rankguard."""
    return str(tmp_path / "image" / "python3")


NO_SITE = [sys.executable, "-S"]  # no site-packages: aiohttp is missing


def entry_cmd(bundle: Path, python: list[str], *agent_args: str, engine: list[str]) -> list[str]:
    return [*python, str(bundle / ENTRY), "launch", "--host", "127.0.0.1", *agent_args, "--", *engine]


def pythonpath_env(bundle: Path, other: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    other.mkdir(exist_ok=True)
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(bundle), str(other)])
    return env


def agent_lines(stderr: bytes) -> list[str]:
    return [line for line in stderr.decode().splitlines() if line.startswith("rankguard-agent:")]


def engine_said(stdout: bytes) -> dict[str, Any]:
    said: dict[str, Any] = json.loads(stdout)
    return said


def assert_engine_kept_off_the_bundle(said: dict[str, Any], bundle: Path, other: Path) -> None:
    # Ours with the bundle taken off (an image's python may append its own after it).
    assert said["PYTHONPATH"] == str(other) or said["PYTHONPATH"].startswith(str(other) + os.pathsep)
    assert str(bundle) not in said["PYTHONPATH"].split(os.pathsep)
    for name in ("rankguard_agent", "pynvml"):
        assert said[name] is None or not Path(said[name]).is_relative_to(bundle), (name, said[name])


async def get_when_served(url: str, timeout: float = 30) -> tuple[int, bytes]:
    """Status and body of GET `url` once something answers there, within `timeout` seconds."""

    def get() -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def answer() -> tuple[int, bytes] | None:
        try:
            return get()
        except (urllib.error.URLError, ConnectionError):
            return None  # nothing listens there yet

    got = await asyncio.to_thread(wait_for, f"{url} to answer", answer, timeout, 0.05)
    assert isinstance(got, tuple)
    return got


def engine_code(tmp_path: Path, ready: str, then: str) -> list[str]:
    """An engine that prints its pid once `ready` ran, then runs `then`; the comment marks it
    as this test's (see stop)."""
    code = f"# {tmp_path}\nimport os, signal, sys, time\n{ready}\nprint(os.getpid(), flush=True)\n{then}"
    return [sys.executable, "-c", code]


async def stop(proc: asyncio.subprocess.Process, tmp_path: Path, engine_pid: int | None) -> None:
    """Kill what a failed test left running: the entry, and the engine (a session of its own
    outlives the entry), the latter only while it still is this test's engine."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
    if engine_pid is None:
        return
    try:
        with open(f"/proc/{engine_pid}/cmdline", "rb") as f:  # noqa: ASYNC230 - a tiny /proc read
            cmdline = f.read()
    except OSError:
        return  # gone
    if str(tmp_path).encode() in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine_pid, signal.SIGKILL)


# ------------------------------------------------------------------------------ the fallback


def test_without_aiohttp_the_engine_runs_without_the_agent(tmp_path: Path) -> None:
    bundle, other = make_bundle(tmp_path), tmp_path / "other"
    cmd = entry_cmd(bundle, NO_SITE, "--port", "0", engine=[sys.executable, "-c", ENGINE])
    proc = subprocess.run(
        cmd, env=pythonpath_env(bundle, other), cwd=tmp_path, capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 3, proc.stderr.decode()
    assert_engine_kept_off_the_bundle(engine_said(proc.stdout), bundle, other)
    lines = agent_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr.decode()
    assert "No module named 'aiohttp'" in lines[0] and "running the engine without rankguard" in lines[0]
    assert b"Traceback" not in proc.stderr


async def test_the_fallback_answers_the_agents_port_with_the_reason(tmp_path: Path) -> None:
    bundle, port, engine_pid = make_bundle(tmp_path), free_port(), None
    engine = engine_code(tmp_path, "", "sys.stdin.read()\nprint('engine done')")  # ends with stdin
    cmd = entry_cmd(bundle, NO_SITE, "--port", str(port), engine=engine)
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        engine_pid = int(await asyncio.wait_for(proc.stdout.readline(), 30))
        status, body = await get_when_served(f"http://127.0.0.1:{port}/report")
        assert status == 503
        error = json.loads(body)["agentError"]
        assert error == "ModuleNotFoundError: No module named 'aiohttp'"
        assert (await get_when_served(f"http://127.0.0.1:{port}/healthz"))[0] == 503
        assert proc.stdin is not None
        proc.stdin.close()
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        assert stdout == b"engine done\n"
        assert agent_lines(stderr) == [
            f"rankguard-agent: cannot start ({error}); running the engine without rankguard"
        ]
    finally:
        await stop(proc, tmp_path, engine_pid)


def test_a_broken_bundle_runs_the_engine_without_the_agent(tmp_path: Path) -> None:
    # On the image's python: aiohttp is there, so the bundle alone is what fails. (Not this
    # venv's: its editable install would find the missing server.py in the checkout.)
    bundle, other = make_bundle(tmp_path, fault="broken"), tmp_path / "other"
    assert not (bundle / "rankguard_agent" / "server.py").exists()
    cmd = entry_cmd(bundle, [image_python3(tmp_path)], "--port", "0", engine=[sys.executable, "-c", ENGINE])
    proc = subprocess.run(
        cmd, env=pythonpath_env(bundle, other), cwd=tmp_path, capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 3, proc.stderr.decode()
    assert_engine_kept_off_the_bundle(engine_said(proc.stdout), bundle, other)
    lines = agent_lines(proc.stderr)
    assert len(lines) == 1 and "No module named 'rankguard_agent.server'" in lines[0], proc.stderr.decode()
    assert b"Traceback" not in proc.stderr


def test_the_install_stand_in_refuses_an_unknown_bundle_fault(tmp_path: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as e:
        make_bundle(tmp_path, fault="brokn")
    assert BUNDLE_ENV.encode() in e.value.stderr


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        ("pass", 128 + signal.SIGTERM),  # killed by the forwarded signal: 143, as a shell says
        ("signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))", 7),  # the engine's own exit
    ],
)
async def test_the_fallback_forwards_sigterm_and_passes_the_engines_exit_on(
    tmp_path: Path, handler: str, expected: int
) -> None:
    bundle, engine_pid = make_bundle(tmp_path), None
    engine = engine_code(tmp_path, handler, "signal.pause()\nsys.exit(9)")
    cmd = entry_cmd(bundle, NO_SITE, "--port", "0", engine=engine)
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path
    )
    try:
        assert proc.stdout is not None
        # The engine is running, so the entry's handlers are in place (installed before it started).
        engine_pid = int(await asyncio.wait_for(proc.stdout.readline(), 30))
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == expected
    finally:
        await stop(proc, tmp_path, engine_pid)


def test_a_missing_engine_fails_as_a_shell_would(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    cmd = entry_cmd(bundle, NO_SITE, "--port", "0", engine=[str(tmp_path / "no-such-engine")])
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 127
    assert len(agent_lines(proc.stderr)) == 2 and b"Traceback" not in proc.stderr


def test_arguments_the_agent_rejects_still_run_the_engine(tmp_path: Path) -> None:
    """A newer operator's flag on an older bundle: the parser's error, then the engine."""
    bundle = make_bundle(tmp_path)
    cmd = entry_cmd(
        bundle, [sys.executable], "--port", "0", "--no-such-flag", engine=[sys.executable, "-c", ENGINE]
    )
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 3, proc.stderr.decode()
    assert b"unrecognized arguments: --no-such-flag" in proc.stderr
    assert agent_lines(proc.stderr) == [
        "rankguard-agent: cannot start (the agent rejected its arguments (exit 2)); "
        "running the engine without rankguard"
    ]


# ------------------------------------------------------------------------------ the full agent


def test_a_healthy_bundle_runs_the_full_agent_and_keeps_the_engine_off_the_bundle(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    bundle, other, tlog = make_bundle(tmp_path), tmp_path / "other", tmp_path / "tl"
    assert (bundle / "pynvml.py").is_file()  # the copy that must not shadow the image's own
    cmd = entry_cmd(
        bundle,
        [sys.executable],
        "--port",
        "0",
        "--termination-log",
        str(tlog),
        engine=[sys.executable, "-c", ENGINE],
    )
    proc = subprocess.run(
        cmd,
        env=pythonpath_env(bundle, other, sim_env),
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr.decode()
    said = engine_said(proc.stdout)
    assert_engine_kept_off_the_bundle(said, bundle, other)
    assert said["pynvml"] is not None  # the image's own nvidia-ml-py, not the bundle's copy
    assert agent_lines(proc.stderr) == [] and b"engine started" in proc.stderr
    assert json.loads(tlog.read_text())["exit_code"] == 3  # written by the full launcher alone


def test_other_subcommands_are_the_full_agents(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(bundle / ENTRY), "--version"], capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 0 and proc.stdout.strip() == b"0.1.0"
    # --version answers where the full agent cannot even import (-S: no aiohttp), as on a
    # serving image's own python3 (the version of the bundle, from its package)
    proc = subprocess.run(
        [sys.executable, "-S", str(bundle / ENTRY), "--version"], capture_output=True, timeout=60, check=False
    )
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, __version__.encode(), b"")
    # Nothing to run without the agent: its own error stands.
    proc = subprocess.run(
        [sys.executable, "-S", str(bundle / ENTRY), "serve"], capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 1 and b"No module named 'aiohttp'" in proc.stderr


# ------------------------------------------------------------------------------ pure rules


def test_engine_env_takes_only_the_bundle_off_pythonpath(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (tmp_path / "link").symlink_to(bundle)
    sep = os.pathsep

    def pythonpath(value: str | None) -> str | None:
        env = {"HOME": "/h"} if value is None else {"HOME": "/h", "PYTHONPATH": value}
        out = engine_env(env, str(bundle))
        assert out["HOME"] == "/h"
        return out.get("PYTHONPATH")

    assert pythonpath(None) is None
    assert pythonpath(str(bundle)) is None  # nothing left: no PYTHONPATH at all
    assert pythonpath(f"{bundle}/{sep}") is None  # an empty entry alone is nothing the user set
    assert pythonpath(f"/a{sep}{bundle}{sep}/b") == f"/a{sep}/b"  # the others stay, in order
    assert pythonpath(f"{tmp_path / 'link'}{sep}{bundle}/{sep}/c") == "/c"  # the same folder, spelt otherwise
    assert pythonpath(f"{bundle}-other{sep}{tmp_path}") == f"{bundle}-other{sep}{tmp_path}"


def test_the_entry_parses_on_python_3_8() -> None:
    ast.parse(AGENT_ENTRY.read_text(), filename=str(AGENT_ENTRY), feature_version=(3, 8))
    assert os.access(AGENT_ENTRY, os.X_OK)


def test_the_image_puts_the_entry_at_the_bundles_root() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    stage = dockerfile.split("AS agent-build", 1)[1].split("\nFROM ", 1)[0]
    assert "COPY agent/rankguard-agent /bundle/rankguard-agent" in stage


def test_start_env_is_queued_per_container_and_taken_once_per_start(tmp_path: Path) -> None:
    from kubernetes import client

    kubelet = ProcessKubelet(client.ApiClient(), "n1", workdir=tmp_path / "w", gpu_root=tmp_path / "g")
    try:
        kubelet.inject_start_env("rankguard-agent-install", 2, {BUNDLE_ENV: "broken"})
        kubelet.inject_start_faults("vllm", 1, "ECC error")
        assert kubelet.take_start_fault("vllm") == {"RANKGUARD_SIM_FAIL_STARTUP": "ECC error"}
        assert kubelet.take_start_fault("vllm") == {}
        first = kubelet.take_start_fault("rankguard-agent-install")
        assert first == {BUNDLE_ENV: "broken"}
        first["X"] = "changed by a caller"
        assert kubelet.take_start_fault("rankguard-agent-install") == {BUNDLE_ENV: "broken"}
        assert kubelet.take_start_fault("rankguard-agent-install") == {}
    finally:
        kubelet.stop()
