"""`rankguard-agent-install DEST` in the sandbox: what the agent image's init container does.

Copies the bundle into DEST: the pure-Python agent package, its entry `rankguard-agent`
(agent/rankguard-agent) at DEST's root, and pynvml, which vLLM images do not reliably ship.
The serving container then runs `python3 DEST/rankguard-agent launch … -- vllm serve …`
with no PYTHONPATH. Runs with the standard library only.

A sandbox fault: RANKGUARD_SIM_AGENT_BUNDLE=broken copies the package without server.py, as
an incomplete bundle would be, so importing the agent fails (ModuleNotFoundError) and the
entry runs the engine without it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ENTRY = "rankguard-agent"  # the bundle's entry file, at its root
BUNDLE_ENV = "RANKGUARD_SIM_AGENT_BUNDLE"  # "broken": leave server.py out (see the docstring)
BROKEN = "broken"
_LEFT_OUT_WHEN_BROKEN = "server.py"


def install(
    agent: Path, dest: Path, pynvml: Path | None = None, entry: Path | None = None, broken: bool = False
) -> list[Path]:
    """Copy the agent package, its entry (default: the `rankguard-agent` next to the package)
    and pynvml into `dest`; returns what was written. `broken` leaves the package's server.py out."""
    if not (agent / "__init__.py").is_file():
        raise FileNotFoundError(f"{agent} is not a Python package")
    entry = agent.parent / ENTRY if entry is None else entry
    if not entry.is_file():
        raise FileNotFoundError(f"{entry}: no agent entry to install")
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / agent.name
    if target.exists():
        shutil.rmtree(target)
    left_out = ["__pycache__", "*.pyc", *([_LEFT_OUT_WHEN_BROKEN] if broken else [])]
    shutil.copytree(agent, target, ignore=shutil.ignore_patterns(*left_out))
    shutil.copy2(entry, dest / ENTRY)
    written = [target, dest / ENTRY]
    if pynvml is not None and pynvml.is_file():
        shutil.copy2(pynvml, dest / pynvml.name)
        written.append(dest / pynvml.name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rankguard-agent-install")
    parser.add_argument("--agent", type=Path, required=True, help="the rankguard_agent package folder")
    parser.add_argument("--entry", type=Path, help=f"the {ENTRY} entry file (default: next to --agent)")
    parser.add_argument("--pynvml", type=Path, help="pynvml.py to bundle next to it")
    parser.add_argument("dest", type=Path, help="where the agent goes (an emptyDir)")
    args = parser.parse_args(argv)
    fault = os.environ.get(BUNDLE_ENV, "")
    if fault not in ("", BROKEN):
        print(f"rankguard-agent-install: {BUNDLE_ENV}={fault!r}: only {BROKEN!r} is known", file=sys.stderr)
        return 2
    try:
        written = install(args.agent, args.dest, args.pynvml, args.entry, broken=fault == BROKEN)
    except OSError as e:
        print(f"rankguard-agent-install: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"installed {path}")
    if fault:
        print(f"rankguard-agent-install: {BUNDLE_ENV}={fault}: the package has no {_LEFT_OUT_WHEN_BROKEN}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
