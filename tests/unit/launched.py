"""Helpers for tests that start the agent's launcher as a process."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from rankguard_agent.report import Report, parse_report

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


async def report_when(port: int, ready: Callable[[Report], bool], tries: int = 200) -> Report:
    """The agent's /report once `ready` holds for it (the last one read after `tries` reads)."""
    async with aiohttp.ClientSession() as s:
        for _ in range(tries):
            async with s.get(f"http://127.0.0.1:{port}/report") as r:
                report = parse_report(await r.read())
            if ready(report):
                break
            await asyncio.sleep(0.05)
    return report


async def stop(proc: asyncio.subprocess.Process) -> None:
    """Kill the launcher if the test left it running (the finally of every test that starts one)."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
