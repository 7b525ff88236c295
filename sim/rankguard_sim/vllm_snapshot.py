"""The real vLLM the fake plays: its recorded snapshot (flags, messages, KV facts).

Every vLLM string the fake prints or accepts comes from
`rankguard_operator.vllm_snapshots` (read out of the real package, never typed here):
`message(key, *values)` renders a recorded log/error template exactly as vLLM does
(`template % values` or `template.format(*values)`), `where(key)` is the `file.py:line`
vLLM's log prefix shows for it.

Which release it plays: `SNAPSHOT_VERSION` (the estimate-sizing engine the sandbox has always
played), unless the engine's version is given (`ENGINE_VERSION_ENV`, which the process kubelet
sets from the container image's tag, or `play(version)`): a release with 0.34's extensible KV
cache (its snapshot's engine.json has `extensible_kv_cache`) is played as itself, with its
flags, messages and facts; every older one as `SNAPSHOT_VERSION`, exactly as before.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from collections.abc import Iterator
from importlib import resources
from typing import Any

from rankguard_operator import vllm_snapshots

SNAPSHOT_VERSION = "0.33.0"


# The engine's version (an image tag's `0.34.0`), set per container by the process kubelet.
ENGINE_VERSION_ENV = "RANKGUARD_SIM_VLLM_VERSION"


def played_version(engine_version: str | None) -> str:
    """The snapshot the fake plays for an engine of `engine_version`: that release's (the nearest
    older recorded one) when it sizes its KV cache after warm-up, else SNAPSHOT_VERSION."""
    if engine_version is None or vllm_snapshots.version_key(engine_version) is None:
        return SNAPSHOT_VERSION
    chosen = vllm_snapshots.for_engine(engine_version).snapshot
    if "+" in chosen.version or "extensible_kv_cache" not in chosen.engine:
        return SNAPSHOT_VERSION
    return chosen.version


def image_engine_version(image: str) -> str | None:
    """The release the fake plays for a container image (`vllm/vllm-openai:v0.34.0` -> 0.34.0,
    `…:v0.31.0` -> SNAPSHOT_VERSION); None for a tag that names no version (`latest`, a digest)."""
    name = image.split("@", 1)[0].rsplit("/", 1)[-1]
    if ":" not in name:
        return None
    tag = name.rsplit(":", 1)[1]
    return played_version(tag) if vllm_snapshots.version_key(tag) is not None else None


def played_releases() -> list[str]:
    """Every release the fake can play (`played_version`'s answers), oldest first."""
    found = {played_version(v) for v in vllm_snapshots.versions()}
    return sorted(found, key=lambda v: vllm_snapshots.version_key(v) or (0, 0, 0))


_played = played_version(os.environ.get(ENGINE_VERSION_ENV))


def play(engine_version: str | None) -> str:
    """Play the release for `engine_version` from now on (in this process); returns its snapshot's
    version. The fake calls it with its environment's ENGINE_VERSION_ENV before parsing flags."""
    global _played
    _played = played_version(engine_version)
    return _played


@contextlib.contextmanager
def playing(engine_version: str | None) -> Iterator[str]:
    """`play(engine_version)` for a block (tests, benchmarks), then the release played before."""
    before = _played
    try:
        yield play(engine_version)
    finally:
        play(before)


def snapshot() -> vllm_snapshots.Snapshot:
    return vllm_snapshots.load(_played)  # cached per version


@functools.cache
def _config_checks(release: str) -> dict[str, Any]:
    path = resources.files(vllm_snapshots) / release / "config_checks.json"
    if not path.is_file():
        return {}
    doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return doc


def config_checks() -> dict[str, Any]:
    """The played release's config_checks.json (hack/vllm-snapshot/config_checks.py: what vLLM
    refuses when it builds a model's configuration), {} for a release recorded without it."""
    return _config_checks(snapshot().version)


def extensible_facts() -> dict[str, Any] | None:
    """The played release's extensible-KV-cache facts (engine.json), None before 0.34."""
    facts = snapshot().engine.get("extensible_kv_cache")
    return dict(facts) if isinstance(facts, dict) else None


def version() -> str:
    """The vLLM version the fake claims (`vllm --version`, the start-up banner, dist-info)."""
    return str(snapshot().cli.get("vllm_version") or snapshot().version)


def format_gib(nbytes: float) -> str:
    """vLLM's `vllm.utils.mem_utils.format_gib`: `f"{round(b / 2**30, 2)}"`."""
    return f"{round(nbytes / 2**30, 2)}"


def _entry(key: str, file_suffix: str | None = None) -> dict[str, Any]:
    found = snapshot().messages(key)
    if not found:
        raise KeyError(f"vLLM {snapshot().version} snapshot has no message {key!r}")
    if file_suffix is not None:
        for entry in found:
            if str(entry["file"]).endswith(file_suffix):
                return entry
    return found[0]


def has(key: str) -> bool:
    """Whether the played release logs message `key` (older and newer ones differ: `absent`)."""
    return bool(snapshot().messages(key))


def arity(key: str, file_suffix: str | None = None) -> int:
    """How many values message `key` takes in the played release (its recorded expressions)."""
    return len(_entry(key, file_suffix).get("exprs") or ())


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


def scenario_block_size() -> int:
    """The block size the scenarios' engine defaults are written at: SNAPSHOT_VERSION's default
    (a scenario is the world's truth, whichever release plays on it)."""
    return vllm_snapshots.load(SNAPSHOT_VERSION).default_block_size


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
