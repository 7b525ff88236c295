"""Properties the planner must keep for ANY model, TP, GPU and measurement (hypothesis)."""

from __future__ import annotations

import json
from dataclasses import replace

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rankguard_operator.cli_plan import plan_doc
from rankguard_operator.core.budget.kv_model import kv_bytes_per_token, stage_kv_layout, stage_range
from rankguard_operator.core.budget.memory_model import activation_bytes, weight_bytes
from rankguard_operator.core.budget.planner import Plan, PlanInput, RankMeasurement, make_plan
from rankguard_operator.core.model.catalog import CATALOG
from rankguard_operator.core.model.shape import ModelShape
from rankguard_operator.core.units import GiB

TPS = (1, 2, 4, 8, 16, 32, 64)


@st.composite
def shapes(draw: st.DrawFn) -> ModelShape:
    head_dim = draw(st.sampled_from([64, 128, 256]))
    kv_heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    heads = kv_heads * group
    hidden = heads * head_dim
    moe = draw(st.booleans())
    experts = draw(st.integers(2, 16)) if moe else 0
    return ModelShape(
        name="hypothetical",
        vocab_size=draw(st.integers(1000, 262_144)),
        hidden_size=hidden,
        num_layers=draw(st.integers(1, 128)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        intermediate_size=draw(st.integers(hidden // 2, 4 * hidden)),
        tie_word_embeddings=draw(st.booleans()),
        num_experts=experts,
        experts_per_token=draw(st.integers(1, experts)) if moe else 0,
        max_position_embeddings=draw(st.sampled_from([2048, 8192, 32768, 131072])),
    )


# Every modelled family of the catalog (MLA, sliding and chunked windows, linear-attention
# hybrids, MoE with dense layers, quantised checkpoints), next to the hypothetical shapes.
CATALOG_SHAPES = sorted((s for s in CATALOG.values() if not s.unmodelled), key=lambda s: s.name)
for _shape in CATALOG_SHAPES:
    # the first plan of an FP8 checkpoint matches its kept-module list once (then cached): do it
    # here, so no example pays for it against hypothesis' deadline
    weight_bytes(_shape, 1)


def any_shapes() -> st.SearchStrategy[ModelShape]:
    return st.one_of(shapes(), st.sampled_from(CATALOG_SHAPES))


def valid_tps(shape: ModelShape) -> list[int]:
    kv = shape.num_kv_heads
    return [
        tp
        for tp in TPS
        if shape.num_heads % tp == 0 and ((kv >= tp and kv % tp == 0) or (kv < tp and tp % kv == 0))
    ]


@st.composite
def plan_inputs(draw: st.DrawFn) -> PlanInput:
    shape = draw(any_shapes())
    tp = draw(st.sampled_from(valid_tps(shape)))
    pp = draw(st.sampled_from([p for p in (1, 2, 4) if p <= shape.num_layers]))
    seqs = draw(st.integers(1, 1024))
    world = tp * pp
    measured = draw(
        st.lists(
            st.builds(
                RankMeasurement,
                rank=st.integers(0, world - 1),
                free_after_init_bytes=st.one_of(st.none(), st.integers(40 * GiB, 79 * GiB)),
                peak_non_kv_bytes=st.one_of(st.none(), st.integers(1 * GiB, 60 * GiB)),
            ),
            max_size=4,
            unique_by=lambda m: m.rank,
        )
    )
    return PlanInput(
        shape=shape,
        gpu_memory_bytes=80 * GiB,
        tp=tp,
        pp=pp,
        kv_cache_dtype=draw(st.sampled_from(["auto", "fp8"])),
        block_size=draw(st.sampled_from([8, 16, 32])),
        max_num_seqs=seqs,
        max_num_batched_tokens=draw(st.integers(max(seqs, 256), 16384)),
        max_model_len=draw(st.sampled_from([1024, 4096, 8192])),
        logits_mode=draw(st.sampled_from(["gather", "all-gather"])),
        safety_margin_bytes=draw(st.integers(0, 2 * GiB)),
        enforce_eager=draw(st.booleans()),
        measured=tuple(measured),
    )


def block_unit(plan: Plan) -> int:
    return plan.block_bytes


@settings(max_examples=300)
@given(plan_inputs())
def test_budget_never_exceeds_any_ranks_safe_bytes(inp: PlanInput) -> None:
    plan = make_plan(inp)
    assert plan.kv_cache_memory_bytes >= 0
    assert plan.kv_cache_memory_bytes % block_unit(plan) == 0
    for r in plan.ranks:
        assert plan.kv_cache_memory_bytes <= max(0, r.safe_kv_bytes - inp.safety_margin_bytes)
        if plan.kv_cache_memory_bytes > 0:
            assert r.headroom_bytes >= inp.safety_margin_bytes
    # the named bottleneck really is the rank with the least room
    assert plan.ranks[plan.bottleneck_rank].safe_kv_bytes == min(r.safe_kv_bytes for r in plan.ranks)
    # and the budget is as large as whole blocks allow
    bottleneck_room = plan.ranks[plan.bottleneck_rank].safe_kv_bytes - inp.safety_margin_bytes
    if bottleneck_room > 0:
        assert plan.kv_cache_memory_bytes > bottleneck_room - block_unit(plan)


@settings(max_examples=300)
@given(plan_inputs())
def test_capacity_is_consistent(inp: PlanInput) -> None:
    plan = make_plan(inp)
    stages = [r.layers for r in plan.ranks[:: inp.tp]]
    layouts = [
        stage_kv_layout(
            inp.shape,
            inp.tp,
            stage_range(stages, s),
            kv_cache_dtype=inp.kv_cache_dtype,
            block_size=inp.block_size,
            max_num_batched_tokens=inp.max_num_batched_tokens,
        )
        for s in range(inp.pp)
    ]
    worst = min(layouts, key=lambda lay: lay.blocks(plan.kv_cache_memory_bytes))
    # vLLM's printed figures: blocks of the tightest stage, tokens = concurrency x max_model_len
    assert plan.kv_blocks == min(r.blocks for r in plan.ranks) == worst.blocks(plan.kv_cache_memory_bytes)
    assert plan.kv_tokens == worst.tokens(plan.kv_cache_memory_bytes, plan.max_model_len)
    for r in plan.ranks:
        assert r.blocks * layouts[r.pp_stage].bytes_per_block <= plan.kv_cache_memory_bytes
    per_request = worst.blocks_per_request(plan.max_model_len)
    assert abs(plan.max_concurrency * per_request - plan.kv_blocks) < 1e-6 * max(1, plan.kv_blocks)
    if all(k == "full" for k in (inp.shape.layer_kinds or ("full",))) and inp.shape.mla is None:
        assert plan.kv_tokens <= plan.kv_blocks * inp.block_size  # full attention: whole blocks
    # the verdict uses the least each rank can need: a budget that holds one request is feasible,
    # and a feasible plan's ranks can hold one beside that least
    if plan.kv_cache_memory_bytes >= plan.min_kv_cache_memory_bytes > 0:
        assert plan.feasible
    if plan.feasible:
        assert min(r.total_bytes - r.least_non_kv_bytes for r in plan.ranks) >= plan.min_kv_cache_memory_bytes
    assert plan.skew_loss_bytes >= 0 and plan.skew_loss_tokens >= 0
    json.dumps(plan_doc(plan, []))  # `rankguard plan --json` can always print it


@settings(max_examples=200)
@given(shapes(), st.integers(1, 1024), st.sampled_from(["gather", "all-gather"]), st.data())
def test_non_kv_never_grows_when_tp_grows(
    shape: ModelShape, seqs: int, mode: str, data: st.DataObject
) -> None:
    """Growing TP never raises any rank's non-KV memory, rank by rank in role (rank 0 against
    rank 0, the most loaded against the most loaded). From TP 1 the model-dependent part
    (weights + activations) obeys this too; the whole non-KV can only grow there because a
    TP-1 process has no NCCL communicator at all (context/NCCL prior, see planner.py)."""
    tps = valid_tps(shape)
    assume(len(tps) >= 2)
    small, large = sorted(data.draw(st.lists(st.sampled_from(tps), min_size=2, max_size=2, unique=True)))

    def plan(tp: int) -> Plan:
        return make_plan(
            PlanInput(
                shape=shape,
                gpu_memory_bytes=80 * GiB,
                tp=tp,
                max_num_seqs=seqs,
                max_num_batched_tokens=max(seqs, 4096),
                logits_mode=mode,  # type: ignore[arg-type]
            )
        )

    assert weight_bytes(shape, large) <= weight_bytes(shape, small)
    assert activation_bytes(shape, large, 4096) <= activation_bytes(shape, small, 4096)
    if small >= 2:
        a, b = plan(small), plan(large)
        assert b.ranks[0].non_kv_bytes <= a.ranks[0].non_kv_bytes
        assert max(r.non_kv_bytes for r in b.ranks) <= max(r.non_kv_bytes for r in a.ranks)
        assert min(r.non_kv_bytes for r in b.ranks) <= min(r.non_kv_bytes for r in a.ranks)


@settings(max_examples=200)
@given(plan_inputs(), st.integers(1, 64 * GiB))
def test_more_gpu_memory_never_shrinks_the_budget(inp: PlanInput, more: int) -> None:
    inp = replace(inp, measured=())  # measured totals would pin the memory
    bigger = replace(inp, gpu_memory_bytes=inp.gpu_memory_bytes + more)
    assert make_plan(bigger).kv_cache_memory_bytes >= make_plan(inp).kv_cache_memory_bytes


@settings(max_examples=200)
@given(plan_inputs(), st.integers(1, 4 * GiB))
def test_a_larger_margin_never_grows_the_budget(inp: PlanInput, more: int) -> None:
    wider = replace(inp, safety_margin_bytes=inp.safety_margin_bytes + more)
    assert make_plan(wider).kv_cache_memory_bytes <= make_plan(inp).kv_cache_memory_bytes


@settings(max_examples=200)
@given(plan_inputs(), st.integers(1, 1024))
def test_more_sequences_never_grow_the_budget(inp: PlanInput, more: int) -> None:
    # more rows of logits and sampler state (peak measurements left out: they replace estimates)
    inp = replace(inp, measured=tuple(replace(m, peak_non_kv_bytes=None) for m in inp.measured))
    busier = replace(
        inp,
        max_num_seqs=inp.max_num_seqs + more,
        max_num_batched_tokens=max(inp.max_num_batched_tokens, inp.max_num_seqs + more),
    )
    assert make_plan(busier).kv_cache_memory_bytes <= make_plan(inp).kv_cache_memory_bytes


@settings(max_examples=200)
@given(plan_inputs())
def test_all_gather_never_allows_more_than_gather(inp: PlanInput) -> None:
    # all-gather puts rank 0's full-vocab buffers on every rank
    gather = make_plan(replace(inp, logits_mode="gather"))
    all_gather = make_plan(replace(inp, logits_mode="all-gather"))
    assert all_gather.kv_cache_memory_bytes <= gather.kv_cache_memory_bytes
    for a, g in zip(all_gather.ranks, gather.ranks, strict=True):
        assert a.logits_bytes >= g.logits_bytes


@settings(max_examples=200)
@given(plan_inputs(), st.data(), st.integers(1, 8 * GiB))
def test_measured_free_memory_moves_that_rank_by_exactly_the_difference(
    inp: PlanInput, data: st.DataObject, less: int
) -> None:
    world = inp.tp * inp.pp
    rank = data.draw(st.integers(0, world - 1))
    inp = replace(inp, measured=())
    base = make_plan(inp)
    r = base.ranks[rank]
    free = r.total_bytes - r.context_bytes - less
    assume(free >= 0)
    moved = make_plan(replace(inp, measured=(RankMeasurement(rank=rank, free_after_init_bytes=free),)))
    assert moved.ranks[rank].safe_kv_bytes == r.safe_kv_bytes - less
    assert moved.kv_cache_memory_bytes <= base.kv_cache_memory_bytes
    for other in moved.ranks:
        if other.rank != rank:
            assert other.safe_kv_bytes == base.ranks[other.rank].safe_kv_bytes
    others = [o.safe_kv_bytes for o in moved.ranks if o.rank != rank]
    if not others or moved.ranks[rank].safe_kv_bytes < min(others):
        assert moved.bottleneck_rank == rank


@given(shapes(), st.data())
def test_kv_heads_replicate_rather_than_vanish(shape: ModelShape, data: st.DataObject) -> None:
    tp = data.draw(st.sampled_from(valid_tps(shape)))
    per_rank, whole = kv_bytes_per_token(shape, tp), kv_bytes_per_token(shape, 1)
    assert per_rank * tp >= whole  # every KV head lives somewhere
    if shape.num_kv_heads % tp == 0:
        assert per_rank * tp == whole
    assert per_rank == kv_bytes_per_token(shape, 1) // shape.num_kv_heads * max(1, shape.num_kv_heads // tp)


@given(shapes(), st.sampled_from([1, 2, 4]))
def test_weights_across_ranks_cover_the_model(shape: ModelShape, tp: int) -> None:
    assume(tp in valid_tps(shape))
    # at TP 1: two bytes per parameter, plus the rows that pad the vocabulary to a multiple of 64
    pad_rows = -(-shape.vocab_size // 64) * 64 - shape.vocab_size
    copies = 1 if shape.tie_word_embeddings else 2  # embedding, and the LM head when untied
    assert weight_bytes(shape, 1) == 2 * shape.num_params() + 2 * pad_rows * shape.hidden_size * copies
    # the TP shards together hold every parameter at least once (more: replicated norms and k/v)
    assert tp * weight_bytes(shape, tp) >= 2 * shape.num_params()
