"""The sizing mode, against vLLM 0.34's own rule (`VllmConfig._resolve_extensible_kv_cache` and
the worker's VMM check), read through the recorded snapshots: the reasons and each connector's
access flags are vLLM's, never typed here."""

from __future__ import annotations

import json

import pytest

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.engine.rules import rules_for
from rankguard_operator.core.engine.sizing_mode import (
    ENGINE_MEASURED,
    PINNED,
    ModeFacts,
    SizingMode,
    connector,
    sizing_mode,
)

V34 = rules_for("0.34.0")
EXT = V34.snapshot.engine["extensible_kv_cache"]


def mode(
    extra: list[str] | None = None, *, pinned: bool = False, version: str = "0.34.0", **facts: object
) -> SizingMode:
    rules = rules_for(version)
    return sizing_mode(
        pinned_by_user=pinned,
        extra_args=extra or [],
        cli=rules.cli,
        facts=ModeFacts(
            version=rules.version, extensible=rules.snapshot.engine.get("extensible_kv_cache"), **facts
        ),  # type: ignore[arg-type]
    )


def kvt(doc: dict[str, object]) -> list[str]:
    return ["--kv-transfer-config", json.dumps(doc)]


def test_a_clean_0_34_service_is_engine_measured() -> None:
    m = mode()
    assert (m.mode, m.reason) == (ENGINE_MEASURED, "EngineMeasures")
    assert m.to_status()["mode"] == "engine-measured"


@pytest.mark.parametrize(
    "version", [v for v in vllm_snapshots.versions() if vllm_snapshots.version_key(v) < (0, 34, 0)]
)
def test_releases_before_0_34_have_no_such_mode(version: str) -> None:
    m = mode(version=version)
    assert m.mode == PINNED
    assert m.reason == ("CpuBuild" if "+cpu" in version else "EngineEstimates")


def test_the_user_s_own_budget_or_block_count_switch_it_off() -> None:
    assert mode(pinned=True).reason == "BudgetPinned"
    assert mode(["--num-gpu-blocks-override", "1000"]).reason == "BlocksOverride"
    assert mode(["--num-gpu-blocks-override=1000"]).reason == "BlocksOverride"


def test_connectors_by_their_recorded_access() -> None:
    # vLLM's own flags for each connector decide; an in-process one keeps the mode
    in_process = [n for n, e in EXT["connectors"].items() if e.get("device") == []]
    assert "ExampleConnector" in in_process
    assert mode(kvt({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})).mode == ENGINE_MEASURED
    # NIXL on device memory exports FABRIC handles: off without an IMEX channel (vLLM's default)
    nixl = kvt({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    assert "EXPORTS_FABRIC" in EXT["connectors"]["NixlConnector"]["device"]
    assert mode(nixl).reason == "NoIMEXChannel"
    assert mode(nixl, imex_channel=False).reason == "NoIMEXChannel"
    assert mode(nixl, imex_channel=True).mode == ENGINE_MEASURED
    # NIXL staging through host memory reaches the cache in-process
    nixl_cpu = kvt({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
    assert mode(nixl_cpu).mode == ENGINE_MEASURED
    # a connector's own memory pool, directly or in a MultiConnector child
    pool = kvt(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"custom_mem_pool": True},
        }
    )
    m = mode(pool)
    assert m.reason == "ConnectorMemoryPool" and EXT["off_reasons"]["custom_mem_pool"] in m.message
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [{"kv_connector": "ExampleConnector"}, {"kv_connector": "NixlConnector"}]
        },
    }
    assert mode(kvt(multi), imex_channel=False).reason == "NoIMEXChannel"
    assert mode(kvt(multi), imex_channel=True).mode == ENGINE_MEASURED


def test_a_connector_the_release_does_not_know_is_pinned() -> None:
    m = mode(kvt({"kv_connector": "SomeoneElsesConnector", "kv_role": "kv_both"}))
    assert m.reason == "ConnectorUnknown"


def test_what_the_agents_and_the_engine_saw() -> None:
    assert mode(vmm=False).reason == "NoVirtualMemory"
    assert mode(vmm=True).mode == ENGINE_MEASURED
    assert mode(engine_disabled="another rank cannot use it").reason == "EngineFellBack"
    assert mode(fallen_back=True).reason == "FellBackAfterOOMs"


def test_the_connector_reader_follows_argparse() -> None:
    cli = V34.cli
    assert connector([], cli) is None
    assert connector(["--kv-transfer-config", "{not json"], cli) is None
    found = connector(kvt({"kv_connector": "A"}) + kvt({"kv_connector": "NixlConnector"}), cli)
    assert found is not None and found.names == ("NixlConnector",)
    dotted = connector(["--kv-transfer-config.kv_connector", "NixlConnector"], cli)
    assert dotted is not None and dotted.names == ("NixlConnector",) and dotted.buffer_device == "cuda"
