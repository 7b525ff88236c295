"""Which vLLM release the fake plays: the default one, or 0.34 when the engine's version (the
image tag) names a release with the extensible KV cache; and what the played release says."""

from __future__ import annotations

import pytest

from rankguard_sim.vllm_snapshot import (
    SNAPSHOT_VERSION,
    arity,
    default_block_size,
    extensible_facts,
    has,
    image_engine_version,
    played_releases,
    played_version,
    playing,
    scenario_block_size,
    snapshot,
    version,
)


@pytest.mark.parametrize(
    ("engine", "played"),
    [
        (None, SNAPSHOT_VERSION),
        ("", SNAPSHOT_VERSION),
        ("not a version", SNAPSHOT_VERSION),
        ("0.30.0", SNAPSHOT_VERSION),
        ("0.33.0", SNAPSHOT_VERSION),
        ("0.32.0+cpu", SNAPSHOT_VERSION),
        ("0.34.0", "0.34.0"),
        ("v0.34.0", "0.34.0"),
        ("0.34.1rc2", "0.34.0"),  # the nearest older recorded release
    ],
)
def test_the_release_played(engine: str | None, played: str) -> None:
    assert played_version(engine) == played


def test_image_tags() -> None:
    assert image_engine_version("vllm/vllm-openai:v0.34.0") == "0.34.0"
    assert image_engine_version("docker.io/vllm/vllm-openai:v0.31.0@sha256:ab") == SNAPSHOT_VERSION
    assert image_engine_version("localhost:5000/vllm") is None  # a registry port is no tag
    assert image_engine_version("vllm/vllm-openai:latest") is None
    assert played_releases() == [SNAPSHOT_VERSION, "0.34.0"]


def test_playing_switches_every_fact_and_back() -> None:
    assert version() == SNAPSHOT_VERSION and extensible_facts() is None
    assert has("model_load_start") and not has("memory_after_warmup")
    with playing("0.34.0") as played:
        assert played == version() == snapshot().version == "0.34.0"
        assert default_block_size() == 64 and scenario_block_size() == 16  # scenarios keep 0.33's
        facts = extensible_facts()
        assert facts is not None and facts["default_utilization"] == 1.0
        assert not has("model_load_start") and has("memory_after_warmup")
        assert arity("kv_too_small") == 5 and arity("no_kv_memory") == 1  # 0.34's carry a hint
    assert version() == SNAPSHOT_VERSION and default_block_size() == 16
    assert arity("kv_too_small") == 4 and arity("no_kv_memory") == 0
