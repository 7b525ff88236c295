"""Across modules: hack/testbin/build.sh fails with one clear line when Go or the module proxy is
missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests import REPO

SCRIPT = REPO / "hack" / "testbin" / "build.sh"


def _run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_missing_go_is_named_with_what_to_do(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "mkdir", "flock", "date", "tail"):
        found = shutil.which(tool)
        assert found, tool
        (bindir / tool).symlink_to(found)
    env = {"PATH": str(bindir), "HOME": str(tmp_path), "RANKGUARD_TESTBIN_CACHE": str(tmp_path / "cache")}
    r = _run(env)
    assert r.returncode == 1
    assert "Go is not installed or not on PATH" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_unreachable_module_proxy_is_named(tmp_path: Path) -> None:
    env = dict(os.environ)
    env.update(
        {
            "RANKGUARD_TESTBIN_CACHE": str(tmp_path / "cache"),
            "GOMODCACHE": str(tmp_path / "modcache"),  # empty: every module must be fetched
            "GOPROXY": "off",
        }
    )
    r = _run(env)
    assert r.returncode == 1
    assert "downloading the Go modules for kubernetes failed" in r.stderr
    assert "GOPROXY" in r.stderr or "proxy" in r.stderr


def test_dir_flag_names_the_versioned_cache_without_building(tmp_path: Path) -> None:
    env = dict(os.environ, RANKGUARD_TESTBIN_CACHE=str(tmp_path))
    r = subprocess.run(["bash", str(SCRIPT), "--dir"], env=env, capture_output=True, text=True, check=True)
    out = Path(r.stdout.strip())
    assert out.parent == tmp_path
    assert out.name.startswith("k8s-v1.34.4_etcd-v3.6.16_helm-")
    assert not out.exists()
