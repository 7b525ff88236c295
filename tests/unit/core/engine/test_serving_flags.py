"""ServingFlags: an engine-measured KV cache never carries a byte budget; what it carries travels
through status and back without loss, and says itself in the columns and Events."""

from __future__ import annotations

import pytest

from rankguard_operator.core.engine.serving_flags import FlagsError, ServingFlags
from rankguard_operator.core.units import GiB


def test_an_engine_measured_cache_has_no_byte_budget() -> None:
    with pytest.raises(FlagsError):
        ServingFlags(engine_measured=True, kv_cache_memory_bytes=GiB)
    # a byte budget takes the sizing over: the measurement is switched off with it
    assert ServingFlags(engine_measured=True, gpu_memory_utilization=0.9).with_kv(GiB) == ServingFlags(
        kv_cache_memory_bytes=GiB
    )


@pytest.mark.parametrize(
    "flags",
    [
        ServingFlags(engine_measured=True),
        ServingFlags(engine_measured=True, gpu_memory_utilization=0.9375, max_num_seqs=64),
        ServingFlags(kv_cache_memory_bytes=20 * GiB, pinned_after_ooms=True),
    ],
)
def test_status_round_trip(flags: ServingFlags) -> None:
    assert ServingFlags.from_status(flags.to_status()) == flags


def test_bad_status_reads_as_nothing() -> None:
    assert ServingFlags.from_status({"engineMeasured": "yes"}) is None
    assert ServingFlags.from_status({"engineMeasured": True, "kvCacheMemoryBytes": GiB}) is None
    assert ServingFlags.from_status({"pinnedAfterOOMs": 1, "kvCacheMemoryBytes": GiB}) is None


def test_what_the_columns_and_events_say() -> None:
    assert ServingFlags(engine_measured=True).budget_text() == "measured"
    reserved = ServingFlags(engine_measured=True, gpu_memory_utilization=0.9)
    assert reserved.budget_text() == "measured, util 0.9"
    assert (
        reserved.describe()
        == "the KV cache vLLM measures after warm-up (reserve: gpu-memory-utilization 0.9)"
    )
    assert reserved.to_status() == {"gpuMemoryUtilization": 0.9, "engineMeasured": True}
