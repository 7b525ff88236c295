"""The real vLLM the fake plays: its recorded snapshot (flags, messages, KV facts).

Every vLLM string the fake prints or accepts comes from
`rankguard_operator.vllm_snapshots` (read out of the real package, never typed here):
`message(key, *values)` renders a recorded log/error template exactly as vLLM does
(`template % values` or `template.format(*values)`), `where(key)` is the `file.py:line`
vLLM's log prefix shows for it.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from rankguard_operator import vllm_snapshots

SNAPSHOT_VERSION = "0.33.0"


@cache
def snapshot() -> vllm_snapshots.Snapshot:
    return vllm_snapshots.load(SNAPSHOT_VERSION)


def version() -> str:
    """The vLLM version the fake claims (`vllm --version`, the start-up banner, dist-info)."""
    return str(snapshot().cli.get("vllm_version") or snapshot().version)


def format_gib(nbytes: float) -> str:
    """vLLM's `vllm.utils.mem_utils.format_gib`: `f"{round(b / 2**30, 2)}"`."""
    return f"{round(nbytes / 2**30, 2)}"


def _entry(key: str, file_suffix: str | None = None) -> dict[str, Any]:
    found = snapshot().messages(key)
    if not found:
        raise KeyError(f"vLLM {SNAPSHOT_VERSION} snapshot has no message {key!r}")
    if file_suffix is not None:
        for entry in found:
            if str(entry["file"]).endswith(file_suffix):
                return entry
    return found[0]


def message(key: str, *values: Any, file_suffix: str | None = None) -> str:
    """vLLM's message `key` with `values`, rendered the way vLLM's own code renders it."""
    entry = _entry(key, file_suffix)
    template = str(entry["template"])
    style = entry["style"]
    if style == "percent":
        return template % values
    if style == "format":
        return template.format(*values)
    if values:
        raise ValueError(f"message {key!r} takes no values (style {style})")
    return template


def message_pattern(key: str, file_suffix: str | None = None) -> re.Pattern[str]:
    """A regex that finds message `key` in a log line, one group per value (a %-template's)."""
    entry = _entry(key, file_suffix)
    if entry["style"] != "percent":
        raise ValueError(f"message {key!r} is not a %-template (style {entry['style']})")
    text = re.escape(str(entry["template"]))
    return re.compile(re.sub(r"%(?:\\\.)?\d*[sdf]", "(.+?)", text) + "$")


def where(key: str, file_suffix: str | None = None) -> str:
    """The `[file.py:line]` part of vLLM's log prefix for message `key`."""
    entry = _entry(key, file_suffix)
    return f"{str(entry['file']).rsplit('/', 1)[-1]}:{entry['line']}"


def download_log_seconds() -> float:
    """vLLM logs the weights' download time only when it took longer than this (weight_utils.py)."""
    return float(snapshot().engine["weights_download_log"]["seconds"])


def distributed_timeout_seconds() -> int:
    """torch's NCCL default timeout, which applies when vLLM gets no --distributed-timeout-seconds."""
    return int(snapshot().engine["distributed_timeout"]["seconds"])


def null_blocks() -> int:
    """Blocks BlockPool holds back (the null block); never usable by requests."""
    return snapshot().null_blocks


def default_block_size() -> int:
    return snapshot().default_block_size


def kv_cache_dtypes() -> tuple[str, ...]:
    return tuple(str(d) for d in snapshot().engine["kv_cache_dtypes"])


def switches_only_in(has: str, lacks: str) -> list[str]:
    """The spellings of value-less options (store-true, on/off switches) that recorded release
    `has` has and release `lacks` does not (by dest), and that `lacks`'s parser cannot read as an
    abbreviation of one of its own flags: a flag one release refuses and the other accepts, found
    in the snapshots rather than named by hand (tests of both tiers try it on rankguard and vLLM)."""
    old = vllm_snapshots.load(lacks).cli["options"]
    lacking = {o["dest"] for o in old}
    spellings = {s for o in old for s in o["option_strings"]}
    return sorted(
        str(s)
        for o in vllm_snapshots.load(has).cli["options"]
        if o["dest"] not in lacking and o["kind"] in ("true", "switch")
        for s in o["option_strings"]
        if not s.startswith("--no-") and not any(x.startswith(s) for x in spellings)
    )
