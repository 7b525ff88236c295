"""The example manifests as files: their documents, and the line `kubectl apply --dry-run=server`
prints for each object (test_examples.py, test_examples_autoscaling.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def dry_run_lines(path: Path, verb: str) -> list[str]:
    """One "<kind>[.<group>]/<name> <verb> (server dry run)" per object of `path` (`verb`:
    "created" for a client-side apply, "serverside-applied" for a server-side one)."""
    lines = []
    for doc in documents(path):
        group = doc["apiVersion"].rpartition("/")[0]
        resource = doc["kind"].lower() + (f".{group}" if group else "")
        lines.append(f"{resource}/{doc['metadata']['name']} {verb} (server dry run)")
    return lines
