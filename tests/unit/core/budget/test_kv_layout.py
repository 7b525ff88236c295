"""kv_layout against the real vLLM 0.33 (tests/fixtures/vllm_kv_layouts.json, written by
hack/vllm-snapshot/kv_layouts.py from vLLM's own planning functions), plus properties.

vLLM itself is not needed here: the fixture is the recorded oracle."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rankguard_operator.core.budget.kv_layout import NULL_BLOCKS, KVLayout, LayerKV, kv_layout
from tests import REPO

FIXTURE = REPO / "tests" / "fixtures" / "vllm_kv_layouts.json"
DOC: dict[str, Any] = json.loads(FIXTURE.read_text())
CASES: list[dict[str, Any]] = DOC["cases"]


def _layout(case: dict[str, Any], *, hybrid: bool | None = None) -> KVLayout:
    return kv_layout(
        [LayerKV(**entry) for entry in case["layers"]],
        case["block_size_arg"],
        hybrid_allocator=case["hybrid_allocator"] if hybrid is None else hybrid,
        max_in_flight_tokens=case["max_in_flight_tokens"],
        mamba_pages_per_request=case["mamba_pages_per_request"],
        mamba_checkpoint_alignment=case["mamba_checkpoint_alignment"],
    )


def test_fixture_is_from_vllm_033() -> None:
    assert DOC["vllm_version"] == "0.33.0"
    assert "kv_layouts.py" in DOC["generated_by"]
    names = {c["name"] for c in CASES}
    for needed in ("llama3.1-8b-tp1", "llama3.1-8b-tp2", "llama3.1-8b-fp8-tp1", "gemma2-9b-like"):
        assert needed in names
    assert any(c["name"].startswith("qwen3-next") for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_layout_matches_vllm(case: dict[str, Any]) -> None:
    got = _layout(case)
    want = case["layout"]
    assert got.block_size == want["block_size"]
    assert got.page_bytes == want["page_bytes"]
    assert got.bytes_per_block == want["bytes_per_block"]
    assert [[g.kind, g.window, g.layers] for g in got.groups] == want["groups"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_capacity_matches_vllm(case: dict[str, Any]) -> None:
    got = _layout(case)
    for mml_text, min_budget in case["min_budget_bytes"].items():
        assert got.min_budget_bytes(int(mml_text)) == min_budget, mml_text
    for r in case["results"]:
        mml, budget = r["max_model_len"], r["budget_bytes"]
        assert (budget < got.min_budget_bytes(mml)) == r["refused"], r
        if r["refused"]:
            continue
        assert got.blocks(budget) == r["num_blocks"], r
        assert got.tokens(budget, mml) == r["tokens"], r
        assert got.max_concurrency(budget, mml) == pytest.approx(r["max_concurrency"], rel=1e-12), r
        assert f"{got.max_concurrency(budget, mml):.2f}" == r["max_concurrency_printed"], r


def test_default_allocator_turns_hma_off_for_chunked_attention() -> None:
    case = next(c for c in CASES if c["name"] == "llama4-like-chunked-default")
    assert case["hybrid_allocator"] is False
    layers = [LayerKV(**entry) for entry in case["layers"]]
    default = kv_layout(layers, case["block_size_arg"], max_in_flight_tokens=case["max_in_flight_tokens"])
    assert default == _layout(case)


@pytest.mark.parametrize("tp_bytes", [4096, 2048, 1024])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_full_attention_only_is_todays_arithmetic(tp_bytes: int, block_size: int) -> None:
    # rankguard's memory_model: blocks = budget // (block_size x per-token bytes),
    # min budget = (ceil(max_model_len / block_size) + null block) x block_size x per-token bytes.
    layers = [LayerKV("full", bytes_per_token=tp_bytes)] * 32
    per_token = 32 * tp_bytes
    got = kv_layout(layers, block_size)
    for budget in (0, 1, 10**9, 37 * 2**30 + 5):
        assert got.blocks(budget) == budget // (block_size * per_token)
    for mml in (1, 4096, 4097, 131072):
        assert got.min_budget_bytes(mml) == (-(-mml // block_size) + NULL_BLOCKS) * block_size * per_token


def test_refuses_what_vllm_refuses() -> None:
    with pytest.raises(ValueError, match="hybrid KV cache manager"):
        kv_layout(
            [LayerKV("mamba", state_bytes=10**6), LayerKV("full", bytes_per_token=2048)],
            16,
            hybrid_allocator=False,
        )
    with pytest.raises(ValueError, match="MLA page"):
        kv_layout(
            [LayerKV("mla", bytes_per_token=1152), LayerKV("chunked", bytes_per_token=2000, window=8)],
            16,
            hybrid_allocator=True,
        )
    # MLA next to plain sliding windows whose pages cannot be unified: full allocation, one group.
    fallback = kv_layout(
        [LayerKV("mla", bytes_per_token=1152), LayerKV("sliding", bytes_per_token=2000, window=8)], 16
    )
    assert [(g.kind, g.layers) for g in fallback.groups] == [("mla", 2)]
    assert fallback.bytes_per_block == 16 * (1152 + 2000)
    assert fallback.blocks_per_request(4096) == 4096 // 16
    with pytest.raises(ValueError):
        kv_layout([], 16)
    with pytest.raises(ValueError):
        kv_layout([LayerKV("sliding", bytes_per_token=1024)], 16)


# --------------------------------------------------------------------------------------------
# Properties over random layer mixes


@st.composite
def models(draw: st.DrawFn) -> tuple[list[LayerKV], int, int]:
    per_token = draw(st.sampled_from([256, 512, 1024, 1152, 2048, 4096]))
    window = draw(st.sampled_from([128, 1024, 4096, 8192]))
    mla = draw(st.booleans())
    attn = draw(
        st.lists(st.sampled_from(["full", "sliding"] if not mla else ["mla"]), min_size=1, max_size=12)
    )
    layers = [
        LayerKV("mla" if k == "mla" else k, bytes_per_token=per_token, window=window if k == "sliding" else 0)
        for k in attn
    ]
    if draw(st.booleans()):
        state = draw(st.integers(1, 3 * 10**6))
        at = draw(st.lists(st.integers(0, len(layers)), max_size=12))
        for i in sorted(at, reverse=True):
            layers.insert(i, LayerKV("mamba", state_bytes=state))
    block_size = draw(st.sampled_from([16, 32, 64]))
    pages = draw(st.integers(1, 3))
    return layers, block_size, pages


@settings(max_examples=200, deadline=None)
@given(models(), st.integers(0, 2**36), st.integers(0, 2**36), st.integers(1, 300_000))
def test_blocks_monotone_and_min_budget_holds_one_request(
    model: tuple[list[LayerKV], int, int], a: int, b: int, mml: int
) -> None:
    layers, block_size, pages = model
    got = kv_layout(layers, block_size, mamba_pages_per_request=pages)
    lo, hi = sorted((a, b))
    assert got.blocks(lo) <= got.blocks(hi)
    assert got.tokens(lo, mml) <= got.tokens(hi, mml)
    assert sum(g.layers for g in got.groups) == len(layers)
    assert got.block_size >= block_size
    need = got.min_budget_bytes(mml)
    # vLLM's check: (budget - one null block's bytes) >= one request's blocks x bytes per block.
    assert got.blocks(need) - NULL_BLOCKS >= got.blocks_per_request(mml)
    assert (need - 1) - got.bytes_per_block < got.blocks_per_request(mml) * got.bytes_per_block
    assert got.max_concurrency(need, mml) >= 1.0
