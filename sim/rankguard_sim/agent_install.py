"""`rankguard-agent-install DEST` in the sandbox: what the agent image's init container does.

Copies the pure-Python agent package (and pynvml, which vLLM images do not reliably ship)
into DEST, so the serving container can run `python3 -m rankguard_agent` with
PYTHONPATH=DEST. Runs with the standard library only.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def install(agent: Path, dest: Path, pynvml: Path | None = None) -> list[Path]:
    """Copy the agent package (and pynvml) into `dest`; returns what was written."""
    if not (agent / "__init__.py").is_file():
        raise FileNotFoundError(f"{agent} is not a Python package")
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / agent.name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(agent, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    written = [target]
    if pynvml is not None and pynvml.is_file():
        shutil.copy2(pynvml, dest / pynvml.name)
        written.append(dest / pynvml.name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rankguard-agent-install")
    parser.add_argument("--agent", type=Path, required=True, help="the rankguard_agent package folder")
    parser.add_argument("--pynvml", type=Path, help="pynvml.py to bundle next to it")
    parser.add_argument("dest", type=Path, help="where the agent goes (an emptyDir)")
    args = parser.parse_args(argv)
    try:
        written = install(args.agent, args.dest, args.pynvml)
    except OSError as e:
        print(f"rankguard-agent-install: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"installed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
