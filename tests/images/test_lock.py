"""The images' lock files and build context, checked without Docker.

- hack/images/requirements-operator.txt pins exactly the runtime dependencies pyproject.toml
  declares (its direct entries, by name), each at a version the declaration allows, and every
  pin carries hashes; hack/images/requirements-build.txt does the same for the build system.
  Both say at their top how to regenerate them.
- The Dockerfile installs from both with --require-hashes, the agent bundle's nvidia-ml-py is
  the lock's, and the build context (.dockerignore's allow-list) lets the locks in.
- The wheel the operator image installs, built from exactly that context, holds the operator
  and agent packages with their data, and not the sandbox (rankguard_sim).

Building and running the images needs Docker: that is hack/images/ci-check.sh, run by .ci/run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
RUNTIME_LOCK = REPO / "hack" / "images" / "requirements-operator.txt"
BUILD_LOCK = REPO / "hack" / "images" / "requirements-build.txt"
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT_SOURCE = "rankguard (pyproject.toml)"


def pyproject() -> dict[str, object]:
    import tomllib  # Python >= 3.11; the test environment is the dev venv

    return tomllib.loads((REPO / "pyproject.toml").read_text())


@dataclass
class Pin:
    name: str
    version: Version
    marker: str
    hashes: list[str] = field(default_factory=list)
    via: list[str] = field(default_factory=list)


def read_lock(path: Path) -> list[Pin]:
    """The pins of a `uv pip compile --generate-hashes` file, with their `# via` sources."""
    pins: list[Pin] = []
    in_via = False
    for line in path.read_text().splitlines():
        stripped = line.strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?:\s*;\s*(.+?))?\s*\\?$", line)
        if m:
            pins.append(Pin(canonicalize_name(m.group(1)), Version(m.group(2)), m.group(3) or ""))
            in_via = False
        elif stripped.startswith("--hash=sha256:"):
            pins[-1].hashes.append(stripped.split(":", 1)[1].rstrip(" \\"))
        elif stripped.startswith("# via"):
            rest = stripped[len("# via") :].strip()
            in_via = not rest
            if rest:
                pins[-1].via.append(rest)
        elif in_via and stripped.startswith("#   "):
            pins[-1].via.append(stripped[len("#   ") :])
        elif stripped and not stripped.startswith("#"):
            raise AssertionError(f"{path.name}: a line this test does not understand: {line!r}")
    return pins


def declared(requirements: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, requirements)}


def check_lock(path: Path, wanted: dict[str, Requirement], direct: set[str]) -> None:
    text = path.read_text()
    assert "hack/images/lock.sh" in "\n".join(text.splitlines()[:5]), f"{path.name}: no regeneration command"
    pins = read_lock(path)
    assert pins, f"{path.name} pins nothing"
    for pin in pins:
        assert pin.hashes, f"{path.name}: {pin.name}=={pin.version} has no hash"
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in pin.hashes), pin
    assert direct == set(wanted), (
        f"{path.name} and pyproject.toml disagree: only in the lock {sorted(direct - set(wanted))}, "
        f"only in pyproject.toml {sorted(set(wanted) - direct)}; run hack/images/lock.sh"
    )
    for pin in pins:
        if pin.name in wanted:
            spec = wanted[pin.name].specifier
            assert spec.contains(pin.version, prereleases=True), (
                f"{path.name} pins {pin.name}=={pin.version}, outside pyproject.toml's {spec}"
            )


def test_the_runtime_lock_pins_exactly_the_declared_dependencies() -> None:
    wanted = declared(pyproject()["project"]["dependencies"])  # type: ignore[index]
    pins = read_lock(RUNTIME_LOCK)
    direct = {p.name for p in pins if PYPROJECT_SOURCE in p.via}
    check_lock(RUNTIME_LOCK, wanted, direct)
    # Nothing of the extras (test tools, torch) crept in.
    names = {p.name for p in pins}
    assert not names & {"torch", "pytest", "hypothesis", "mypy", "ruff", "cryptography"}, names


def test_the_build_lock_pins_exactly_the_build_system() -> None:
    wanted = declared(pyproject()["build-system"]["requires"])  # type: ignore[index]
    pins = read_lock(BUILD_LOCK)
    # Its input is pyproject.toml's build-system table on stdin: the top-level pins are those
    # nothing else in the file pulled in.
    direct = {p.name for p in pins if not p.via}
    check_lock(BUILD_LOCK, wanted, direct)


def test_the_reader_understands_what_uv_writes(tmp_path: Path) -> None:
    lock = tmp_path / "lock.txt"
    lock.write_text(
        "# This file was autogenerated by uv via the following command:\n"
        "#    hack/images/lock.sh\n"
        "aiohttp==3.14.5 \\\n"
        f"    --hash=sha256:{'a' * 64} \\\n"
        f"    --hash=sha256:{'b' * 64}\n"
        "    # via\n"
        "    #   rankguard (pyproject.toml)\n"
        "    #   kopf\n"
        "async-timeout==5.0.1 ; python_full_version < '3.11' \\\n"
        f"    --hash=sha256:{'c' * 64}\n"
        "    # via aiohttp\n"
    )
    first, second = read_lock(lock)
    assert (first.name, str(first.version), first.via) == ("aiohttp", "3.14.5", [PYPROJECT_SOURCE, "kopf"])
    assert first.hashes == ["a" * 64, "b" * 64]
    assert (second.marker, second.via) == ("python_full_version < '3.11'", ["aiohttp"])
    with pytest.raises(AssertionError, match="disagree"):
        check_lock(lock, declared(["aiohttp>=3.9", "kopf>=1.37"]), {"aiohttp"})
    with pytest.raises(AssertionError, match="outside"):
        check_lock(lock, declared(["aiohttp>=4"]), {"aiohttp"})


def test_the_dockerfile_installs_from_the_locks_with_hashes() -> None:
    text = " ".join(DOCKERFILE.read_text().replace("\\\n", " ").split())
    for lock in (RUNTIME_LOCK, BUILD_LOCK):
        assert f"pip install --require-hashes -r /locks/{lock.name}" in text
    assert "--no-deps /wheels/rankguard-" in text  # the project itself: the lock has its deps
    # The agent bundle's pynvml is the lock's nvidia-ml-py.
    arg = re.search(r"ARG NVIDIA_ML_PY_VERSION=(\S+)", text)
    assert arg
    (pin,) = [p for p in read_lock(RUNTIME_LOCK) if p.name == "nvidia-ml-py"]
    assert Version(arg.group(1)) == pin.version, "the agent bundle and the operator lock disagree"


def build_context(dest: Path) -> None:
    """Copy what the Docker build context holds: .dockerignore's allow-list, less its ignores."""
    allowed = [
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", "*.egg-info", ".*_cache")
    for rel in allowed:
        src, out = REPO / rel, dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, out, ignore=ignore)
        else:
            shutil.copy2(src, out)


def test_the_operator_wheel_from_the_build_context_has_no_sandbox(tmp_path: Path) -> None:
    # Built without isolation (no network in tests), so this venv's setuptools must do.
    import setuptools

    (backend,) = [r for r in pyproject()["build-system"]["requires"] if r.startswith("setuptools")]  # type: ignore[index]
    assert Requirement(backend).specifier.contains(setuptools.__version__), (
        f"this venv's setuptools {setuptools.__version__} cannot build the wheel ({backend})"
    )
    context = tmp_path / "context"
    build_context(context)
    assert not (context / "sim").exists()
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(context),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = wheels.glob("rankguard-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert {"rankguard_operator", "rankguard_agent"} <= tops
    assert "rankguard_sim" not in tops, "the operator image would package the sandbox"
    assert any(n.startswith("rankguard_operator/vllm_snapshots/") and n.endswith(".json") for n in names)
    assert any(n.startswith("rankguard_operator/catalog/") for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()
