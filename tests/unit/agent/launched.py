"""Helpers for tests that start the agent's launcher as a process."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import aiohttp

from rankguard_agent.wire.report import Report, parse_report
from rankguard_agent.wire.termination import (
    MAX_TERMINATION_BYTES,
    TerminationMessage,
    parse_termination_message,
)
from tests import REPO

AGENT_ROOT = REPO / "agent"  # what PYTHONPATH gives the launcher
_LISTENING = re.compile(rb"http://127\.0\.0\.1:(\d+)")


async def agent_port(proc: asyncio.subprocess.Process, timeout: float = 30) -> int:
    """The port the launched agent serves on, read from its start-up line on stderr."""
    assert proc.stderr is not None
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), timeout)
        assert line, "launcher ended early"
        found = _LISTENING.search(line)
        if found:
            return int(found.group(1))


async def start(cmd: Sequence[str], env: Mapping[str, str]) -> asyncio.subprocess.Process:
    """The launcher as a process, its output piped (the tests read its start-up line)."""
    return await asyncio.create_subprocess_exec(
        *cmd, env=dict(env), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )


async def report_when(port: int, ready: Callable[[Report], bool], timeout: float = 30) -> Report:
    """The agent's /report once `ready` holds for it, polled until `timeout` seconds have
    passed (then the last one read, for the caller's assertions to say what was missing)."""
    deadline = asyncio.get_running_loop().time() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            async with s.get(f"http://127.0.0.1:{port}/report") as r:
                report = parse_report(await r.read())
            if ready(report) or asyncio.get_running_loop().time() > deadline:
                return report
            await asyncio.sleep(0.05)  # the poll interval of a bounded wait, not a synchronisation


async def stop(proc: asyncio.subprocess.Process, grace: float = 30) -> None:
    """Stop the launcher if the test left it running (the finally of every test that starts one).

    SIGTERM first, as the kubelet does: the launcher passes it to the engine, which runs in a
    session of its own, and waits for it. A SIGKILL alone left that engine running after the
    test (an orphan the next tests on a 2-core CI machine compete with). SIGKILL only when the
    launcher has not exited within `grace` seconds, an upper bound on a wait for its exit."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def launcher_cmd(tlog: Path | str, child: list[str], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rankguard_agent",
        "launch",
        "--port",
        "0",
        "--host",
        "127.0.0.1",
        "--termination-log",
        str(tlog),
        *extra,
        "--",
        *child,
    ]


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def run(
    env: dict[str, str], tlog: Path | str, child: list[str], timeout: float = 60
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        launcher_cmd(tlog, child), env=env, capture_output=True, timeout=timeout, check=False
    )


def message(tlog: Path) -> TerminationMessage:
    text = tlog.read_text()
    assert len(text.encode()) <= MAX_TERMINATION_BYTES
    return parse_termination_message(text)
