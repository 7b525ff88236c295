"""vLLM 0.34's extensible KV cache rules as the world plays them: the facts read from the recorded
0.34.0 snapshot, `resolve_mode` against `_resolve_extensible_kv_cache`'s cases, and the
measurement against hand-worked cases of `measure_kv_cache_bytes`' docstring."""

from __future__ import annotations

import dataclasses

import pytest

from rankguard_operator import vllm_snapshots
from rankguard_sim.physics.extensible_kv import (
    ExtensibleFacts,
    Mode,
    WarmupMeasurement,
    measure_kv_cache_blocks,
    measure_kv_cache_bytes,
    resolve_mode,
    transfer_access,
)

GIB = 1 << 30
MIB = 1 << 20


@pytest.fixture(scope="module")
def facts() -> ExtensibleFacts:
    return ExtensibleFacts.from_engine(vllm_snapshots.load("0.34.0").engine["extensible_kv_cache"])


def test_the_facts_are_the_recorded_cuda_ones(facts: ExtensibleFacts) -> None:
    assert (facts.margin_floor_bytes, facts.margin_fraction) == (GIB, 0.75)
    assert facts.non_torch_reserve_bytes == 512 * MIB
    assert (facts.default_utilization, facts.estimate_default_utilization) == (1.0, 0.92)
    assert (facts.warn_above, facts.warn_below, facts.warn_withheld_bytes) == (0.7, 1.0, GIB)
    assert facts.access("NixlConnector") == {"REGISTERS", "EXPORTS_FABRIC"}
    assert facts.access("NixlConnector", "cpu") == frozenset()
    assert facts.access("LMCacheMPConnector") == frozenset()  # recorded with its import error


# ---------------------------------------------------------------------------------------------
# The mode: _resolve_extensible_kv_cache


def test_unset_is_on_where_supported(facts: ExtensibleFacts) -> None:
    assert resolve_mode(facts, requested=None) == Mode(True)
    assert resolve_mode(facts, requested=True) == Mode(True)


@pytest.mark.parametrize(
    ("flags", "reason"),
    [
        ({"kv_cache_memory_bytes": 20 * GIB}, "kv_cache_memory_bytes"),
        ({"num_gpu_blocks_override": 1000}, "num_gpu_blocks_override"),
        ({"elastic_ep": True}, "elastic_ep"),
        ({"custom_mem_pool": True}, "custom_mem_pool"),
    ],
)
def test_what_overrides_the_measurement_turns_it_off_and_refuses_it_asked_for(
    facts: ExtensibleFacts, flags: dict[str, object], reason: str
) -> None:
    assert resolve_mode(facts, requested=None, **flags) == Mode(False, reason)  # type: ignore[arg-type]
    refused = resolve_mode(facts, requested=True, **flags)  # type: ignore[arg-type]
    assert not refused.enabled
    assert refused.error == f"enable_extensible_kv_cache: {facts.off_reasons[reason]}."


def test_the_order_of_the_chain_decides_the_reason(facts: ExtensibleFacts) -> None:
    both = resolve_mode(facts, requested=None, kv_cache_memory_bytes=GIB, num_gpu_blocks_override=10)
    assert both.reason == "kv_cache_memory_bytes"


def test_a_legacy_ipc_connector_turns_it_off(facts: ExtensibleFacts) -> None:
    # no recorded connector of 0.34.0 imports here with LEGACY_IPC (LMCacheMP's package is absent)
    mp = dataclasses.replace(facts, connectors={"LMCacheMPConnector": {"device": ("LEGACY_IPC",)}})
    access, _ = transfer_access(mp, {"kv_connector": "LMCacheMPConnector"})
    assert resolve_mode(mp, requested=None, access=access) == Mode(False, "legacy_ipc")


def test_fabric_exports_without_an_imex_channel_turn_the_default_off_only(facts: ExtensibleFacts) -> None:
    access, pool = transfer_access(facts, {"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    assert "EXPORTS_FABRIC" in access and not pool
    assert resolve_mode(facts, requested=None, access=access) == Mode(False, "imex_channel")
    assert resolve_mode(facts, requested=None, access=access, imex_channel=True) == Mode(True)
    # asked for, it stays on: only transfers within a host lose NVLink (vLLM warns)
    assert resolve_mode(facts, requested=True, access=access) == Mode(True)
    # NIXL over CPU buffers exports nothing
    cpu, _ = transfer_access(facts, {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"})
    assert resolve_mode(facts, requested=None, access=cpu) == Mode(True)


def test_multi_connector_children_count(facts: ExtensibleFacts) -> None:
    multi = {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector"},
                {"kv_connector": "MooncakeConnector", "kv_connector_extra_config": {"custom_mem_pool": True}},
            ]
        },
    }
    access, pool = transfer_access(facts, multi)
    assert "EXPORTS_FABRIC" in access and pool
    mode = resolve_mode(facts, requested=None, access=access, custom_mem_pool=pool)
    assert mode.reason == "custom_mem_pool"


def test_a_connector_that_imports_by_file_descriptor_needs_it(facts: ExtensibleFacts) -> None:
    fd = frozenset({"EXPORTS_FD"})
    assert resolve_mode(facts, requested=None, access=fd) == Mode(True)
    off = resolve_mode(facts, requested=False, access=fd)
    assert off.error is not None and off.error.endswith("needs it, but it is disabled.")
    pinned = resolve_mode(facts, requested=None, access=fd, kv_cache_memory_bytes=GIB)
    assert pinned.error is not None and facts.off_reasons["kv_cache_memory_bytes"] in pinned.error


def test_switched_off_by_the_flag(facts: ExtensibleFacts) -> None:
    assert resolve_mode(facts, requested=False) == Mode(False, "disabled")


# ---------------------------------------------------------------------------------------------
# The measurement


def _bytes(**kw: int) -> int:
    return measure_kv_cache_bytes(margin_floor_bytes=GIB, margin_fraction=0.75, **kw)


def test_the_cache_gets_the_headroom_less_the_margin_and_the_transient() -> None:
    # 40 GiB used by the engine since the snapshot; 30 free: margin max(1, 0.75 × 2) = 1.5
    got = _bytes(
        init_free_memory=70 * GIB,
        free_memory=30 * GIB,
        committed_bytes=0,
        requested_memory=80 * GIB,
        transient_peak_bytes=2 * GIB,
        torch_reserve_growth_bytes=GIB,
    )
    assert got == int(28.5 * GIB) - 2 * GIB


def test_the_requested_budget_binds_before_the_headroom() -> None:
    got = _bytes(
        init_free_memory=70 * GIB,
        free_memory=30 * GIB,
        committed_bytes=0,
        requested_memory=60 * GIB,  # 60 − 40 used = 20 < 28.5
        transient_peak_bytes=2 * GIB,
    )
    assert got == 18 * GIB


def test_the_committed_prefix_is_headroom_not_use() -> None:
    base = {"init_free_memory": 70 * GIB, "requested_memory": 80 * GIB, "transient_peak_bytes": 2 * GIB}
    assert _bytes(free_memory=29 * GIB, committed_bytes=GIB, **base) == _bytes(
        free_memory=30 * GIB, committed_bytes=0, **base
    )


def test_the_margin_floor_and_the_larger_of_peak_and_growth() -> None:
    small = _bytes(
        init_free_memory=70 * GIB,
        free_memory=30 * GIB,
        committed_bytes=0,
        requested_memory=80 * GIB,
        transient_peak_bytes=GIB // 2,  # 0.75 × 0.5 < the 1 GiB floor
    )
    assert small == 29 * GIB - GIB // 2
    grown = _bytes(
        init_free_memory=70 * GIB,
        free_memory=30 * GIB,
        committed_bytes=0,
        requested_memory=80 * GIB,
        transient_peak_bytes=GIB,
        torch_reserve_growth_bytes=3 * GIB,  # kept in full, the margin still from the peak
    )
    assert grown == 26 * GIB


def test_nothing_left_is_zero_not_negative() -> None:
    assert _bytes(init_free_memory=GIB, free_memory=GIB // 2, committed_bytes=0, requested_memory=GIB) == 0


def _measure(facts: ExtensibleFacts, utilization: float | None) -> WarmupMeasurement:
    return measure_kv_cache_blocks(
        facts,
        rank=0,
        init_free=78 * GIB,
        free=38 * GIB,
        committed=0,
        requested=int(80 * GIB * (utilization or 1.0)),
        transient_peak=GIB,
        torch_growth=GIB // 2,
        torch_reserved=30 * GIB,
        block_bytes=64 * MIB,
        capacity_blocks=10**6,
        utilization=utilization,
    )


def test_blocks_and_torchs_cap(facts: ExtensibleFacts) -> None:
    m = _measure(facts, 0.85)  # requested 68 GiB: min(68 − 40, 38 − 1) − 1 = 27 GiB
    assert m.available_bytes == 27 * GIB
    assert m.blocks == 27 * 16
    # torch keeps what it held plus what stays free once extended, less the non-torch reserve
    assert m.torch_cap_bytes == 30 * GIB + (38 - 27) * GIB - 512 * MIB
    assert m.kept_bytes == GIB


@pytest.mark.parametrize(
    ("utilization", "withheld", "warns"),
    [
        (0.85, 9 * GIB, True),  # unbounded: min(38, 37) − 1 = 36 GiB; 36 − 27
        (0.95, GIB, True),  # 76 − 40 = 36 − 1 = 35: exactly 1 GiB withheld
        (0.96, None, False),  # computed below
        (0.6, None, False),  # not strictly between 0.7 and 1.0: not checked
        (None, None, False),  # unset: not checked
    ],
)
def test_the_utilisation_warning(
    facts: ExtensibleFacts, utilization: float | None, withheld: int | None, warns: bool
) -> None:
    m = _measure(facts, utilization)
    if utilization == 0.96:
        assert m.withheld_bytes == 36 * GIB - m.available_bytes < GIB
    else:
        assert m.withheld_bytes == withheld
    assert m.warns(facts) is warns
