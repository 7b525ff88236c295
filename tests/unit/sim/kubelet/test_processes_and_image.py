"""Across modules: a container as local processes (kubelet/pod/proc), and the sandbox's one "image"
its commands run from (kubelet/image).

A container's processes are found by their marker even after they leave its session; the
image's python has the third-party packages but not rankguard's own (the agent reaches a pod
only through its init container's install) and reports the recorded vLLM version without a
vLLM to import.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rankguard_sim.kubelet.agent_install import install
from rankguard_sim.kubelet.image import build_image
from rankguard_sim.kubelet.pod.proc import CONTAINER_ENV, container_pids
from tests import REPO

# ------------------------------------------------------------------------------ processes and image


def test_container_pids_follow_the_marker_across_sessions() -> None:
    marker = f"test/{os.getpid()}/{time.monotonic_ns()}"
    # The child starts a grandchild in its own session: only the marker still finds it. The child
    # names the grandchild once it runs Python: Popen returns when the kernel closes the exec pipe,
    # before the new program's environment is in place (/proc/PID/environ then reads empty).
    code = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; print(1, flush=True); time.sleep(30)'],"
        " start_new_session=True, stdout=subprocess.PIPE);"
        "p.stdout.readline(); print(p.pid, flush=True); time.sleep(30)"
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
    """The agent reads importlib.metadata.version("vllm") in the vLLM container; the image's
    python also imports the stand-in `vllm` package (its version the same), the test process not."""
    from rankguard_sim.vllm_snapshot import version

    table = build_image(tmp_path / "bin")
    probe = (
        "import importlib.metadata as m, importlib.util as u;"
        "print(m.version('vllm'), u.find_spec('vllm').origin.endswith('sim/vllm_standin/vllm/__init__.py'));"
        "import vllm; print(vllm.__version__)"
    )
    out = subprocess.run(
        [table.commands["python3"], "-c", probe],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "pod")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert version() == "0.33.0"
    assert out.stdout.split() == ["0.33.0", "True", "0.33.0"]
    # Nothing leaks into this (the test) process: no "vllm" distribution, no `vllm` package here.
    import importlib.metadata
    import importlib.util

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    assert importlib.util.find_spec("vllm") is None
    assert not list((REPO / "sim").rglob("vllm-*.dist-info"))


@pytest.mark.parametrize(
    ("played", "reported"), [("0.34.0", "0.34.0"), ("0.33.0", "0.33.0"), ("9.9.9", "0.33.0"), ("", "0.33.0")]
)
def test_image_python_reports_the_release_its_container_plays(
    tmp_path: Path, played: str, reported: str
) -> None:
    """The kubelet sets RANKGUARD_SIM_VLLM_VERSION from the image tag: a 0.34 image's metadata says 0.34."""
    from rankguard_sim.vllm_snapshot import ENGINE_VERSION_ENV

    table = build_image(tmp_path / "bin")
    env = {"PATH": "/usr/bin:/bin", **({ENGINE_VERSION_ENV: played} if played else {})}
    probe = "import importlib.metadata as m; print(m.version('vllm'))"
    out = subprocess.run(
        [table.commands["python3"], "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == reported
    # -I ignores the pod's PYTHONPATH, never the image's own packages
    isolated = subprocess.run(
        [table.commands["python3"], "-I", "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert isolated.stdout.strip() == reported


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
