"""`make bench` runs something that exists, and every benchmark it names is there."""

from __future__ import annotations

import re
import subprocess
import sys

from tests import REPO


def test_make_bench_runs_a_script_that_exists() -> None:
    """Before: the Makefile's bench target ran bench/run_all.py, which did not exist."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe is not None
    scripts = re.findall(r"(bench/\S+\.py)", recipe.group(1))
    assert scripts and all((REPO / s).is_file() for s in scripts), scripts


def test_run_all_names_only_benchmarks_that_exist_and_answers_help() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import run_all
    finally:
        sys.path.pop(0)
    for script, _, _ in run_all.BENCHMARKS.values():
        assert (REPO / "bench" / script).is_file(), script
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run_all.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--quick" in out and "--only" in out
