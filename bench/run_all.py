"""`make bench`: every benchmark in bench/, one after the other, each printing its own table.

    python bench/run_all.py [--quick] [--only NAME ...]

`--quick` shortens the runs that take a duration or a trial count (for a smoke check; the
figures in docs/benchmarks.md come from the full runs). Each benchmark runs as its own
process, exactly as its docstring says to run it alone; the exit code is non-zero when any
of them failed, and the summary names which.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

BENCH = Path(__file__).resolve().parent

# name -> (script, full arguments, quick arguments)
BENCHMARKS: dict[str, tuple[str, list[str], list[str]]] = {
    "strategies": ("compare_strategies.py", [], ["--no-trace"]),
    "agent": ("agent_bench.py", [], ["--seconds", "5", "--requests", "100"]),
    "reaction": ("operator_reaction.py", [], ["--trials", "5"]),
    "scale": (
        "operator_scale.py",
        [],
        ["--services", "10", "--window", "20", "--settle", "5", "--changes", "5", "--report-changes", "5"],
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="shorter runs, for a smoke check")
    ap.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these")
    args = ap.parse_args(argv)
    results: list[tuple[str, int, float]] = []
    for name in args.only or list(BENCHMARKS):
        script, full, quick = BENCHMARKS[name]
        cmd = [sys.executable, str(BENCH / script), *(quick if args.quick else full)]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        code = subprocess.run(cmd, check=False).returncode
        results.append((name, code, time.monotonic() - started))
    print("\n=== summary")
    for name, code, seconds in results:
        print(f"  {name:<11} {'ok' if code == 0 else f'FAILED (exit {code})':<18} {seconds:6.0f}s")
    return 0 if all(code == 0 for _, code, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
