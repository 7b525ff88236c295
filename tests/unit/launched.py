"""Helpers for tests that start the agent's launcher as a process."""

from __future__ import annotations

import asyncio
import re

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
