"""Memory Python has freed but glibc's malloc would keep in the operator's RSS: fewer places to
keep it (two arenas, set once at start by edge/main) and handed back once a minute (the task
edge/handlers starts). The API calls run in worker threads and decode their JSON there, and a
thousand services' first passes and every status the watches decode leave freed memory behind;
both measured at N=1,000 in docs/benchmarks.md. Off glibc both do nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import os

_M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)
TRIM_EVERY_SECONDS = 60.0  # freed memory handed back to the system this often


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def fewer_malloc_arenas() -> bool:
    """Two glibc malloc arenas instead of up to eight per core (what MALLOC_ARENA_MAX=2 does,
    set here so no install has to remember it; an explicit MALLOC_ARENA_MAX wins). Call it before
    any thread starts. With an arena per thread, each keeps its own freed-but-unreturned memory,
    which at a thousand services was tens of MiB of RSS that Python no longer held. Returns
    whether it was set (False off glibc)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _libc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, 2))


def trim_freed_memory() -> bool:
    """Hand the memory Python has freed back to the system (glibc's malloc_trim, which also
    releases free pages inside the heap). Returns whether memory was released (False off glibc)."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


async def trim_periodically(every: float = TRIM_EVERY_SECONDS) -> None:
    """`trim_freed_memory` every `every` seconds, until cancelled. At 1,000 Running services the
    operator's RSS was 308 MiB without it (docs/benchmarks.md)."""
    while True:
        await asyncio.sleep(every)
        trim_freed_memory()
