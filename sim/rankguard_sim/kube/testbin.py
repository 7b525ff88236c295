"""Where the control-plane binaries built by hack/testbin/build.sh live."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = REPO_ROOT / "hack" / "testbin" / "build.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "helm")


class TestbinMissing(RuntimeError):
    """The control-plane binaries are not built yet; the message says how to build them."""


def testbin_dir() -> Path:
    """The folder holding the binaries: $RANKGUARD_TESTBIN, else what build.sh --dir names.

    Never builds (a cold build takes tens of minutes); raises TestbinMissing instead.
    """
    env = os.environ.get("RANKGUARD_TESTBIN")
    if env:
        path = Path(env)
    else:
        if not BUILD_SCRIPT.exists():
            raise TestbinMissing(
                f"{BUILD_SCRIPT} is missing; set RANKGUARD_TESTBIN to a folder with {BINARIES}"
            )
        out = subprocess.run(["bash", str(BUILD_SCRIPT), "--dir"], capture_output=True, text=True, check=True)
        path = Path(out.stdout.strip())
    missing = [b for b in BINARIES if not (path / b).is_file()]
    if missing:
        raise TestbinMissing(
            f"control-plane binaries missing in {path}: {', '.join(missing)}. "
            "Build them once with `bash hack/testbin/build.sh` (or `make testbin`)."
        )
    return path
