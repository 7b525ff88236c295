"""Across modules: the long-running agent imports only what a vLLM image has (plus pynvml), and
never torch.

Runs the real commands (`python -m rankguard_agent serve|launch`, through runpy) in a
subprocess that records which modules were loaded by the time it exits, drives the
endpoints so lazily imported code runs too, and checks each top-level name against the
standard library and the allowed distributions (with the packages they require).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rankguard_agent.gpu.simfiles import write_device
from tests import REPO

AGENT_ROOT = REPO / "agent"
ALLOWED_DISTRIBUTIONS = ("aiohttp", "prometheus_client", "PyYAML", "nvidia-ml-py")
FORBIDDEN = ("torch", "rankguard_operator", "rankguard_sim", "kopf", "kubernetes", "numpy")


def _requirement_names(dist: str) -> list[str]:
    out = []
    for req in md.requires(dist) or []:
        if "extra ==" in req or "extra==" in req:
            continue  # optional extras are not installed by the plain dependency
        name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0]
        out.append(name)
    return out


def allowed_top_level() -> set[str]:
    """Top-level import names of the allowed distributions and everything they require."""
    seen: set[str] = set()
    todo = list(ALLOWED_DISTRIBUTIONS)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            todo.extend(_requirement_names(name))
        except md.PackageNotFoundError:
            continue  # an optional-by-marker requirement this Python does not install
    allowed = {"rankguard_agent"}
    for top, dists in md.packages_distributions().items():
        if any(d.lower().replace("_", "-") in seen for d in dists):
            allowed.add(top)
    return allowed


# Runs the agent's real entry point; at exit, writes the modules it loaded (site's own
# start-up imports, present before the agent ran, are not the agent's doing).
RECORDER = """
import atexit, json, runpy, sys
before = set(sys.modules)
out = sys.argv[1]
def dump():
    with open(out, "w") as f:
        json.dump(sorted(set(sys.modules) - before), f)
atexit.register(dump)
sys.argv = ["rankguard_agent", *sys.argv[2:]]
runpy.run_module("rankguard_agent", run_name="__main__", alter_sys=True)
"""


def agent_cmd(record: Path, *args: str) -> list[str]:
    return [sys.executable, "-c", RECORDER, str(record), *args]


def imported_modules(record: Path) -> set[str]:
    return set(json.loads(record.read_text()))


def offenders(modules: set[str]) -> set[str]:
    allowed = allowed_top_level() | set(sys.stdlib_module_names)
    # Cython-compiled extensions (aiohttp's, multidict's, yarl's) register their shared
    # runtime under these names; they are part of those packages, not separate imports.
    tops = {m.split(".")[0] for m in modules if not (m.startswith("_cython_") or m == "cython_runtime")}
    # "_cffi_backend"-style private C modules of allowed packages show up under their own names.
    return {t for t in tops if t not in allowed and t.lstrip("_") not in allowed}


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "gpus"
    write_device(root, "GPU-0", index=0, total_bytes=1 << 34)
    e = dict(os.environ)
    e.update({"PYTHONPATH": str(AGENT_ROOT), "RANKGUARD_SIM_GPU_ROOT": str(root)})
    return e


@pytest.mark.parametrize("backend", ["sim", "nvml"])
def test_serve_imports_only_the_allowed_set(env: dict[str, str], tmp_path: Path, backend: str) -> None:
    record = tmp_path / "modules.json"
    cmd = agent_cmd(record, "serve", "--backend", backend, "--host", "127.0.0.1", "--port", "0")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 60
        port = None
        assert proc.stderr is not None
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "serve ended early:\n" + "".join(lines[-20:])
            lines.append(line)
            found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            port = int(found.group(1)) if found else None
        assert port is not None
        for path in ("/healthz", "/report", "/metrics"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    modules = imported_modules(record)
    assert "rankguard_agent.server" in modules and "aiohttp" in modules  # the listing is real
    assert not {m for m in modules if m.split(".")[0] in FORBIDDEN}
    assert offenders(modules) == set()
    if backend == "nvml":
        assert "pynvml" in modules
    else:
        assert "pynvml" not in modules  # the sim backend never loads NVML


def test_launch_without_probe_never_imports_torch(env: dict[str, str], tmp_path: Path) -> None:
    record = tmp_path / "modules.json"
    cmd = agent_cmd(record, "launch", "--host", "127.0.0.1", "--port", "0", "--termination-log",
                    str(tmp_path / "tl"), "--", sys.executable, "-c", "pass")  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = imported_modules(record)
    assert "rankguard_agent.launcher" in modules and "rankguard_agent.probe" in modules
    assert not {m for m in modules if m.split(".")[0] in FORBIDDEN}
    assert offenders(modules) == set()


def test_the_check_itself_catches_an_outsider() -> None:
    assert offenders({"json", "aiohttp.web", "multidict", "yaml", "torch.nn", "rankguard_sim"}) == {
        "torch",
        "rankguard_sim",
    }
