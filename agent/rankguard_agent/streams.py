"""The engine's output streams: passed through byte for byte to the agent's own stdout and
stderr, while a copy is cut into lines for the recognisers.

Bad input never takes the engine down: an oversized line is cut for scanning only, invalid
UTF-8 is replaced for scanning only, and a closed or slow reader of our own output is logged
once and survived (the engine keeps running; its lines are still scanned).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Callable

from rankguard_agent.constants import MAX_SCAN_LINE

log = logging.getLogger("rankguard_agent.launcher")

_CHUNK = 64 * 1024


class LineScanner:
    """Cuts a copy of a byte stream into text lines for the recognisers.

    A line longer than `cap` bytes is cut to its first `cap` bytes (the figures rankguard
    looks for sit at the start of a line); invalid UTF-8 becomes U+FFFD. Neither changes
    what passes through, which never goes through this class.
    """

    def __init__(
        self,
        on_line: Callable[[str], None],
        cap: int = MAX_SCAN_LINE,
        name: str = "output",
        on_cut: Callable[[str, int], None] | None = None,
    ) -> None:
        self.on_line = on_line
        self.on_cut = on_cut
        self.cap = cap
        self.name = name
        self.cut_lines = 0
        self._buf = bytearray()
        self._overflow = False

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                self._append(data, start, len(data))
                return
            self._append(data, start, nl)
            self._emit()
            start = nl + 1

    def close(self) -> None:
        if self._buf or self._overflow:
            self._emit()

    def _append(self, data: bytes, start: int, end: int) -> None:
        room = self.cap - len(self._buf)
        if end - start > room:
            self._overflow = True
            end = start + max(room, 0)
        if end > start:
            self._buf += data[start:end]

    def _emit(self) -> None:
        line = self._buf.decode("utf-8", "replace").rstrip("\r")
        self._buf = bytearray()
        if self._overflow:
            self._overflow = False
            self.cut_lines += 1
            if self.on_cut is not None:
                self.on_cut(self.name, self.cap)
        try:
            self.on_line(line)
        except Exception:  # a recogniser bug must not stop the stream
            log.exception("%s: scanning a line failed", self.name)


class Output:
    """Writes passthrough bytes to one of our own fds, surviving a closed or slow reader."""

    def __init__(self, fd: int, name: str) -> None:
        self.fd = fd
        self.name = name
        self.broken = False

    async def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self.broken:
            try:
                n = os.write(self.fd, view)
            except BlockingIOError:
                await asyncio.sleep(0.001)  # our stdout is non-blocking and full: wait a little
                continue
            except OSError as e:
                self.broken = True
                if e.errno != errno.EPIPE:
                    log.error("cannot write the engine's %s (%s); still scanning it", self.name, e)
                return
            view = view[n:]


async def pump(stream: asyncio.StreamReader, out: Output, scanner: LineScanner) -> None:
    while True:
        data = await stream.read(_CHUNK)
        if not data:
            break
        await out.write(data)
        scanner.feed(data)
    scanner.close()
