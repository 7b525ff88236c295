"""Which vLLM release's rules apply to a service: from the image tag before the engine runs, from
the version the agent reports once it does.

The rules are a recorded snapshot (rankguard_operator/vllm_snapshots/); for a version with no
snapshot the nearest older one is used and `Rules.note` says so (the service's EngineRules
condition carries it), so an unknown engine never stops the operator.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.engine.vllm_cli import VllmCli

# `vllm/vllm-openai:v0.33.0`, `registry:5000/x/vllm:0.33.0-cu129`; a digest-only reference has no tag
_TAG = re.compile(r":([^:/@]+)(?:@.*)?$")


def image_version(image: str) -> str | None:
    """The vLLM version an image's tag names (`v0.33.0` -> `0.33.0`), or None (`latest`, a digest)."""
    m = _TAG.search(image)
    if m is None:
        return None
    key = vllm_snapshots.version_key(m.group(1))
    return None if key is None else "{}.{}.{}".format(*key)


@dataclass(frozen=True)
class Rules:
    snapshot: vllm_snapshots.Snapshot
    cli: VllmCli
    note: str | None  # None: the engine's own version was recorded

    @property
    def version(self) -> str:
        return self.snapshot.version


@cache
def rules_for(version: str | None) -> Rules:
    choice = vllm_snapshots.for_engine(version)
    snap = choice.snapshot
    connectors = tuple((snap.extensible or {}).get("connectors", {}))
    return Rules(snap, VllmCli(snap.cli, snap.version, snap.surface, connectors), choice.note)


def rules_for_image(image: str) -> Rules:
    return rules_for(image_version(image))
