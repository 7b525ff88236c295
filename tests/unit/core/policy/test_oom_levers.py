"""Rule 1 by phase: each CUDA OOM moves the lever for the engine phase it came from, and no other.
(Over 450 lines because every lever is followed from the decision through status, history, the
render and the spec's floors in the one policy world, where each figure is known.)

Profile run: max-num-batched-tokens, then max-num-seqs; KV allocation and an unknown phase: the
KV budget as before; CUDA-graph capture: the KV budget while it stays above its floor, then
max-cudagraph-capture-size, then enforce-eager; sampler warm-up and serving: the KV budget, then
max-num-seqs; weights: nothing rolls, Degraded with the split that would fit. Each lever keeps
its floor (spec.remediation.levers), the same phase failing again within the escalation window
moves the next lever, and with none left the service is Degraded with its flags unchanged. The
levers are ServingFlags: status, history, render, supersession, guard rails and rollback carry
every one of them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from rankguard_agent.wire import termination as tm
from rankguard_operator.core.budget.bounds import after_kv_bytes
from rankguard_operator.core.engine.rules import rules_for_image
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.observe.pods import Termination, terminations
from rankguard_operator.core.policy import decide
from rankguard_operator.core.policy.decision import Decision
from rankguard_operator.core.policy.history import Remediation, history_from_status
from rankguard_operator.core.policy.oom_levers import escalation_run
from rankguard_operator.core.policy.tunables import ESCALATION_WINDOW_SECONDS
from rankguard_operator.core.render.pod import vllm_args
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB, MiB, format_bytes
from tests.unit.core.policy_world import (
    CUR,
    DOC,
    FAILED,
    FLOOR,
    KV,
    MARGIN,
    NOW,
    PLAN,
    SPEC,
    UNIT,
    inp,
    spec_with,
    term,
)


def oom(phase: str | None, flags: ServingFlags | None = CUR, **kw: Any) -> Termination:
    return replace(term(flags=flags, **kw), phase=phase)


def moved(d: Decision, age: float = 120.0) -> Remediation:
    """`d` as history keeps it, made `age` seconds ago."""
    return d.remediation(NOW - age)


def changed_fields(a: ServingFlags, b: ServingFlags) -> set[str]:
    return {k for k in ("kv_cache_memory_bytes", "gpu_memory_utilization", "memory_limit_bytes",
                        "max_num_seqs", "max_num_batched_tokens", "max_cudagraph_capture_size",
                        "enforce_eager") if getattr(a, k) != getattr(b, k)}  # fmt: skip


def after(d: Decision, phase: str, age: float = 120.0, **kw: Any) -> Decision:
    """The same phase failing again under the flags `d` set, with `d` in the history."""
    return decide(
        inp(current=d.flags, history=[moved(d, age)], new_terminations=[oom(phase, flags=d.flags)], **kw)
    )


# --- each phase moves its own lever, and no other ------------------------------------------------


def test_a_profile_run_oom_halves_the_batched_tokens_and_nothing_else() -> None:
    d = decide(inp(new_terminations=[oom(tm.PHASE_PROFILE)]))
    assert (d.action, d.reason, d.phase, d.lever) == (
        "lower-batched-tokens",
        "LowerMaxNumBatchedTokens",
        "profile",
        "max-num-batched-tokens",
    )
    assert d.flags == replace(CUR, max_num_batched_tokens=4096)
    assert changed_fields(CUR, d.flags) == {"max_num_batched_tokens"}
    assert d.is_remediation and d.lever_from == 8192
    assert d.message == (
        "rank 2 ran out of GPU memory in pod llama-0 (tried to allocate 2Gi with 512Mi free) in the profile "
        "run; lowering --max-num-batched-tokens from 8192 (spec.engine.maxNumBatchedTokens) to 4096 "
        "(lever max-num-batched-tokens, the 1st of 2 for this phase)"
    )


def test_the_profile_run_escalates_to_max_num_seqs_and_keeps_halving_it_to_its_floor() -> None:
    first = decide(inp(new_terminations=[oom(tm.PHASE_PROFILE)]))
    second = after(first, tm.PHASE_PROFILE)
    assert (second.action, second.reason, second.lever) == (
        "lower-num-seqs",
        "LowerMaxNumSeqs",
        "max-num-seqs",
    )
    assert changed_fields(first.flags, second.flags) == {"max_num_seqs"}
    assert second.flags.max_num_seqs == 128 and second.flags.max_num_batched_tokens == 4096
    assert "lowering --max-num-seqs from 256 (spec.engine.maxNumSeqs) to 128" in second.message
    # the ladder's last lever keeps moving: 128 -> 64 -> 32 -> 16 -> 8 (the default floor); the
    # hourly limit allows it here (at the default 4 it holds the fifth change, as for the budget)
    spec = spec_with(remediation={"maxPerHour": 10})
    history, d = [moved(first, 600), moved(second, 500)], second
    for want in (64, 32, 16, 8):
        d = decide(
            inp(
                spec=spec,
                current=d.flags,
                history=history,
                new_terminations=[oom(tm.PHASE_PROFILE, flags=d.flags)],
            )
        )
        assert (d.action, d.flags.max_num_seqs) == ("lower-num-seqs", want)
        history.append(moved(d, 400 - want))
    done = decide(
        inp(
            spec=spec,
            current=d.flags,
            history=history,
            new_terminations=[oom(tm.PHASE_PROFILE, flags=d.flags)],
        )
    )
    assert (done.action, done.reason, done.flags, done.changes_flags) == (
        "degrade",
        "OOMLeversExhausted",
        d.flags,
        False,
    )
    assert "max-num-seqs 8 is at its floor 8 (spec.remediation.levers.minNumSeqs)" in done.message
    assert "max-num-batched-tokens 8192 -> 4096, max-num-seqs 256 -> 128" in done.message


def test_batched_tokens_never_drop_below_max_num_seqs_nor_their_floor() -> None:
    spec = spec_with(
        engine={"maxNumSeqs": 512, "maxNumBatchedTokens": 1024},
        remediation={"levers": {"minNumBatchedTokens": 64}},
    )
    d = decide(inp(spec=spec, new_terminations=[oom(tm.PHASE_PROFILE)]))
    assert d.flags.max_num_batched_tokens == 512  # not 512 // 2: vLLM refuses fewer tokens than sequences
    # at the spec's default floor (1024) the batched tokens cannot move: max-num-seqs moves first
    at_floor = spec_with(engine={"maxNumBatchedTokens": 1024})
    d = decide(inp(spec=at_floor, new_terminations=[oom(tm.PHASE_PROFILE)]))
    assert (d.lever, d.flags) == ("max-num-seqs", replace(CUR, max_num_seqs=128))
    assert "max-num-batched-tokens 1024 is at its floor 1024" in d.message


def test_batched_tokens_stay_at_max_model_len_when_chunked_prefill_is_off() -> None:
    spec = spec_with(engine={"maxModelLen": 8192, "extraArgs": ["--disable-chunked-prefill"]})
    assert spec.engine.chunked_prefill_off
    d = decide(inp(spec=spec, new_terminations=[oom(tm.PHASE_PROFILE)]))
    assert d.lever == "max-num-seqs"  # 8192 tokens is max_model_len: vLLM would refuse fewer
    assert "max-model-len: chunked prefill is off" in d.message


def test_a_kv_allocation_oom_is_rule_1_with_its_phase_kept_and_room_for_what_comes_after() -> None:
    unknown = decide(inp(new_terminations=[oom(None)]))
    kv = decide(inp(new_terminations=[oom(tm.PHASE_KV_ALLOCATION)]))
    assert (unknown.action, unknown.lever, unknown.phase) == ("shrink", None, None)
    # an OOM of unknown phase: the deficit (1.5 GiB) and the margin, as before
    assert unknown.flags == ServingFlags(kv_cache_memory_bytes=KV - 1639 * UNIT)
    # the KV allocation's also leaves room for what start-up and serving allocate after the cache
    # (issue 50: without it the next start failed at capture): the CUDA-graph pool, then the
    # sampler warm-up or a step's activations, whichever is larger (one pipeline stage: no
    # NCCL memory created by pipeline traffic)
    r2 = PLAN.ranks[2]
    room = after_kv_bytes(PLAN, 2, enforce_eager=False)
    assert room == r2.cudagraph_bytes + max(r2.activation_bytes, r2.logits_bytes + r2.sampler_bytes)
    assert r2.cudagraph_bytes > 0 and r2.logits_bytes + r2.sampler_bytes > 0
    deficit = 2 * GiB - 512 * MiB  # term(): tried to allocate 2 GiB with 512 MiB free
    assert kv.flags == ServingFlags(kv_cache_memory_bytes=(KV - deficit - MARGIN - room) // UNIT * UNIT)
    assert (kv.action, kv.lever, kv.phase) == ("shrink", "kv-budget", "kv-allocation")
    assert f"plus {format_bytes(room)} for the CUDA-graph pool, the sampler warm-up" in kv.message
    # under --enforce-eager nothing is captured: only the step's transients are left room for
    eager = replace(CUR, enforce_eager=True)
    kv_eager = decide(inp(current=eager, new_terminations=[oom(tm.PHASE_KV_ALLOCATION, flags=eager)]))
    steps = room - r2.cudagraph_bytes
    assert kv_eager.flags.kv_cache_memory_bytes == (KV - deficit - MARGIN - steps) // UNIT * UNIT
    assert f"plus {format_bytes(steps)} for a step's transients" in kv_eager.message
    assert "while allocating the KV cache" in kv.message
    # the only lever of this phase keeps moving: a second OOM shrinks again
    again = after(kv, tm.PHASE_KV_ALLOCATION)
    assert again.action == "shrink" and again.flags.kv_cache_memory_bytes < kv.flags.kv_cache_memory_bytes  # type: ignore[operator]


def test_cuda_graph_capture_climbs_kv_then_capture_size_then_eager_then_gives_up() -> None:
    kv = decide(inp(new_terminations=[oom(tm.PHASE_CUDA_GRAPHS)]))
    assert (kv.action, kv.lever, kv.phase) == ("shrink", "kv-budget", "cuda-graph-capture")
    assert changed_fields(CUR, kv.flags) == {"kv_cache_memory_bytes"}
    assert "during CUDA-graph capture" in kv.message and "lever kv-budget, the 1st of 3" in kv.message

    capture = after(kv, tm.PHASE_CUDA_GRAPHS)
    assert (capture.action, capture.reason, capture.lever) == (
        "lower-capture-size",
        "LowerCudaGraphCaptureSize",
        "max-cudagraph-capture-size",
    )
    assert changed_fields(kv.flags, capture.flags) == {"max_cudagraph_capture_size"}
    assert capture.flags.max_cudagraph_capture_size == 256
    # vLLM 0.33's default: min(2 × max-num-seqs 256, 512, max-num-batched-tokens 8192) = 512
    assert "from 512 (vLLM's default: min(2 × max-num-seqs 256, 512, 8192)) to 256" in capture.message

    history = [moved(kv, 600), moved(capture, 300)]
    eager = decide(
        inp(
            current=capture.flags,
            history=history,
            new_terminations=[oom(tm.PHASE_CUDA_GRAPHS, flags=capture.flags)],
        )
    )
    assert (eager.action, eager.reason, eager.lever) == ("enforce-eager", "EnforceEager", "enforce-eager")
    assert (
        changed_fields(capture.flags, eager.flags) == {"enforce_eager"} and eager.flags.enforce_eager is True
    )
    assert "turning on --enforce-eager (lever enforce-eager, the 3rd of 3" in eager.message

    history.append(moved(eager, 100))
    done = decide(
        inp(
            current=eager.flags,
            history=history,
            new_terminations=[oom(tm.PHASE_CUDA_GRAPHS, flags=eager.flags)],
        )
    )
    assert (done.action, done.reason, done.changes_flags) == ("degrade", "OOMLeversExhausted", False)
    assert len(done.handled) == 1  # the OOM is accounted for: said once, not decided again
    assert done.flags == eager.flags and "enforce-eager is already on" in done.message


def test_cuda_graph_capture_skips_the_kv_budget_when_it_would_cross_its_floor() -> None:
    near = ServingFlags(kv_cache_memory_bytes=FLOOR + 4 * UNIT)
    d = decide(inp(current=near, new_terminations=[oom(tm.PHASE_CUDA_GRAPHS, flags=near)]))
    assert (d.action, d.flags) == ("lower-capture-size", replace(near, max_cudagraph_capture_size=256))
    assert "below its floor" in d.message


def test_a_pinned_budget_forbids_only_the_kv_lever() -> None:
    pinned = spec_with(memory={"kvCacheMemoryBytes": 30 * GiB})
    cur = ServingFlags(kv_cache_memory_bytes=30 * GiB)
    d = decide(inp(spec=pinned, current=cur, new_terminations=[oom(tm.PHASE_CUDA_GRAPHS, flags=cur)]))
    assert (d.action, d.flags) == ("lower-capture-size", replace(cur, max_cudagraph_capture_size=256))
    assert "the KV budget is pinned" in d.message
    # an unknown phase under a pinned budget stays as before: Degraded, naming the knob
    old = decide(inp(spec=pinned, current=cur, new_terminations=[oom(None, flags=cur)]))
    assert (old.action, old.reason) == ("degrade", "PinnedBudgetOOM")


def test_the_users_own_capture_sizes_are_left_alone() -> None:
    spec = spec_with(
        engine={"maxModelLen": 8192, "extraArgs": ["--cudagraph-capture-sizes", "1", "2", "4", "8"]}
    )
    assert spec.engine.capture_sizes_flag == "--cudagraph-capture-sizes"
    near = ServingFlags(kv_cache_memory_bytes=FLOOR)
    d = decide(inp(spec=spec, current=near, new_terminations=[oom(tm.PHASE_CUDA_GRAPHS, flags=near)]))
    assert (d.action, d.flags) == ("enforce-eager", replace(near, enforce_eager=True))
    assert "spec.engine.extraArgs set the capture sizes (--cudagraph-capture-sizes)" in d.message


def test_capture_size_floor_and_no_eager_allowed_end_degraded() -> None:
    spec = spec_with(remediation={"levers": {"minCudaGraphCaptureSize": 512, "allowEnforceEager": False}})
    near = ServingFlags(kv_cache_memory_bytes=FLOOR)
    d = decide(inp(spec=spec, current=near, new_terminations=[oom(tm.PHASE_CUDA_GRAPHS, flags=near)]))
    assert (d.action, d.reason, d.flags) == ("degrade", "OOMLeversExhausted", near)
    assert "max-cudagraph-capture-size 512 is at its floor 512" in d.message
    assert "enforce-eager is not allowed (spec.remediation.levers.allowEnforceEager: false)" in d.message


@pytest.mark.parametrize("phase", [tm.PHASE_SAMPLER_WARMUP, tm.PHASE_SERVING])
def test_sampler_warmup_and_serving_cut_kv_then_num_seqs(phase: str) -> None:
    kv = decide(inp(new_terminations=[oom(phase)]))
    assert (kv.action, kv.lever, kv.phase) == ("shrink", "kv-budget", phase)
    seqs = after(kv, phase)
    assert (seqs.action, seqs.lever) == ("lower-num-seqs", "max-num-seqs")
    assert changed_fields(kv.flags, seqs.flags) == {"max_num_seqs"}


def test_escalation_needs_the_same_phase_within_the_window() -> None:
    kv = decide(inp(new_terminations=[oom(tm.PHASE_SERVING)]))
    # an hour and more later the ladder starts again from its cheapest lever
    late = after(kv, tm.PHASE_SERVING, age=ESCALATION_WINDOW_SECONDS + 1)
    assert late.lever == "kv-budget"
    # another phase's OOM does not escalate this one
    other = after(kv, tm.PHASE_CUDA_GRAPHS)
    assert other.lever == "kv-budget"
    # any other change in between ends the run
    reclaim = Remediation(NOW - 60, "Reclaim", "grow", None, kv.flags, kv.flags)
    assert escalation_run([moved(kv), reclaim], tm.PHASE_SERVING, NOW) == []
    assert escalation_run([moved(kv)], tm.PHASE_SERVING, NOW) == [moved(kv)]


def test_weights_that_do_not_fit_degrade_with_the_split_that_would_and_roll_nothing() -> None:
    d = decide(inp(new_terminations=[oom(tm.PHASE_WEIGHTS)]))
    assert (d.action, d.reason, d.phase, d.flags, d.changes_flags) == (
        "degrade",
        "WeightsDoNotFit",
        "weights",
        CUR,
        False,
    )
    assert "while loading the weights" in d.message
    assert "the planner says spec.tensorParallelSize 8 would fit on these GPUs" in d.message
    # the deficit says how much bigger a GPU must be: 80Gi + 1.5Gi + the 512Mi margin
    assert "GPUs with at least 82Gi each would hold the current split" in d.message
    no_plan = decide(inp(plan=None, new_terminations=[oom(tm.PHASE_WEIGHTS)]))
    assert (
        no_plan.reason == "WeightsDoNotFit"
        and "rankguard has no plan to say what would fit" in no_plan.message
    )


def test_an_oom_of_a_pod_that_ran_other_levers_is_superseded() -> None:
    cur = replace(CUR, max_num_seqs=128)
    d = decide(inp(current=cur, new_terminations=[oom(tm.PHASE_SERVING, flags=CUR)]))
    assert (d.action, d.changes_flags) == ("none", False) and d.handled


def test_the_guard_rails_hold_a_lever_like_the_budget() -> None:
    grow = Remediation(NOW - 60, "Reclaim", "grow", None, ServingFlags(kv_cache_memory_bytes=KV - GiB), CUR)
    held = decide(inp(history=[grow, grow], new_terminations=[oom(tm.PHASE_PROFILE, flags=CUR)]))
    # the last change made the current flags, so a crash under them is fixed at once (no cooldown) ...
    assert held.action == "lower-batched-tokens"
    other = replace(grow, to_flags=ServingFlags(kv_cache_memory_bytes=KV - GiB))
    held = decide(inp(history=[other], new_terminations=[oom(tm.PHASE_PROFILE)]))
    # ... a crash under flags some other change made waits for the cooldown
    assert (held.action, held.reason, held.held_action) == ("hold", "CooldownActive", "lower-batched-tokens")
    off = spec_with(remediation={"enabled": False})
    d = decide(inp(spec=off, new_terminations=[oom(tm.PHASE_PROFILE)]))
    assert (d.action, d.reason, d.flags) == ("hold", "RemediationDisabled", CUR)


def test_a_rollback_restores_every_lever() -> None:
    lkg = ServingFlags(kv_cache_memory_bytes=KV)
    cur = replace(lkg, max_num_seqs=64, max_cudagraph_capture_size=128, enforce_eager=True)
    d = decide(inp(current=cur, last_known_good=lkg, rollout=FAILED))
    assert (d.action, d.flags) == ("rollback", lkg)


# --- status, history, render, spec ---------------------------------------------------------------


def test_serving_flags_round_trip_every_lever() -> None:
    f = ServingFlags(
        kv_cache_memory_bytes=KV,
        memory_limit_bytes=64 * GiB,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_cudagraph_capture_size=128,
        enforce_eager=True,
    )
    doc = f.to_status()
    assert doc == {
        "kvCacheMemoryBytes": KV,
        "memoryLimit": "64Gi",
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 2048,
        "maxCudaGraphCaptureSize": 128,
        "enforceEager": True,
    }
    assert ServingFlags.from_status(doc) == f
    assert ServingFlags.from_status({"maxNumSeqs": 8}) == ServingFlags(max_num_seqs=8)
    assert ServingFlags.from_status({"maxNumSeqs": "8"}) is None  # a hand-edited status: nothing, no crash
    assert f.describe() == (
        "kv-cache-memory-bytes 37Gi, max-num-seqs 64, max-num-batched-tokens 2048, "
        "max-cudagraph-capture-size 128, enforce-eager, memory limit 64Gi"
    )


@pytest.mark.parametrize(
    "bad", [{"max_num_seqs": 0}, {"max_cudagraph_capture_size": True}, {"enforce_eager": 1}]
)
def test_impossible_levers_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ServingFlags(**bad)


def test_history_keeps_phase_lever_and_the_levers_values() -> None:
    d = decide(inp(new_terminations=[oom(tm.PHASE_SAMPLER_WARMUP)]))
    seqs = after(d, tm.PHASE_SAMPLER_WARMUP)
    r = moved(seqs)
    doc = r.to_status()
    assert (doc["phase"], doc["lever"], doc["action"], doc["from"], doc["to"]) == (
        "sampler-warmup",
        "max-num-seqs",
        "LowerMaxNumSeqs",
        256,
        128,
    )
    assert doc["toFlags"]["maxNumSeqs"] == 128
    assert history_from_status([doc]) == [r]
    # written without the flags objects (an older schema pruned them), the lever's scalars still read back
    bare = {k: v for k, v in doc.items() if k not in ("fromFlags", "toFlags")}
    (back,) = history_from_status([bare])
    assert (back.lever, back.lever_from, back.to_flags) == (
        "max-num-seqs",
        256,
        ServingFlags(max_num_seqs=128),
    )
    eager = Remediation(NOW, "CUDAOutOfMemory", "enforce-eager", 0, CUR, replace(CUR, enforce_eager=True),
                        phase="cuda-graph-capture", lever="enforce-eager", lever_from=False)  # fmt: skip
    edoc = eager.to_status()
    assert (edoc["action"], edoc["from"], edoc["to"]) == ("EnforceEager", "false", "true")
    assert history_from_status([edoc]) == [eager]


def _rendered(spec: Any, flags: ServingFlags) -> list[str]:
    args = vllm_args(spec, flags, PLAN)
    assert rules_for_image(spec.image).cli.check_serve(args) == []  # vLLM 0.33 reads it
    return args


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_each_lever_is_rendered_in_place_of_the_spec() -> None:
    plain = _rendered(SPEC, CUR)
    assert (_flag(plain, "--max-num-seqs"), _flag(plain, "--max-num-batched-tokens")) == ("256", "8192")
    assert "--max-cudagraph-capture-size" not in plain and "--enforce-eager" not in plain
    levers = replace(CUR, max_num_seqs=64, max_num_batched_tokens=2048, max_cudagraph_capture_size=128)
    args = _rendered(SPEC, levers)
    assert (_flag(args, "--max-num-seqs"), _flag(args, "--max-num-batched-tokens")) == ("64", "2048")
    assert _flag(args, "--max-cudagraph-capture-size") == "128" and "--enforce-eager" not in args
    eager = _rendered(SPEC, replace(levers, enforce_eager=True))
    assert (
        "--enforce-eager" in eager and "--max-cudagraph-capture-size" not in eager
    )  # eager captures nothing
    mine = spec_with(engine={"maxModelLen": 8192, "extraArgs": ["-cc.cudagraph_capture_sizes+", "1,2,4"]})
    assert "--max-cudagraph-capture-size" not in _rendered(mine, levers)  # vLLM would refuse the pair


def test_an_extra_arg_cannot_set_rankguards_capture_size() -> None:
    doc = json.loads(json.dumps(DOC))
    doc["engine"]["extraArgs"] = ["--max-cudagraph-capture-size", "64"]
    with pytest.raises(SpecError, match=r"is owned by rankguard.*--cudagraph-capture-sizes"):
        parse_spec(doc)
    doc["engine"]["extraArgs"] = ["--compilation-config", '{"max_cudagraph_capture_size": 4k}']
    assert (
        parse_spec(doc).engine.capture_sizes_flag == "--compilation-config (its max_cudagraph_capture_size)"
    )


def test_the_levers_floors_are_parsed_and_checked() -> None:
    assert (SPEC.remediation.levers.min_num_seqs, SPEC.remediation.levers.min_num_batched_tokens) == (8, 1024)
    assert (
        SPEC.remediation.levers.min_cudagraph_capture_size,
        SPEC.remediation.levers.allow_enforce_eager,
    ) == (
        8,
        True,
    )
    floors = {"minNumSeqs": 32, "minNumBatchedTokens": 4096, "minCudaGraphCaptureSize": 64}
    s = spec_with(remediation={"levers": {**floors, "allowEnforceEager": False}})
    lv = s.remediation.levers
    assert (
        lv.min_num_seqs,
        lv.min_num_batched_tokens,
        lv.min_cudagraph_capture_size,
        lv.allow_enforce_eager,
    ) == (
        32,
        4096,
        64,
        False,
    )
    for bad, needle in (
        ({"minNumSeqs": 0}, r"spec.remediation.levers.minNumSeqs must be between 1 and 65536"),
        ({"minNumBatchedTokens": 10**8}, r"spec.remediation.levers.minNumBatchedTokens must be between"),
        (
            {"minCudaGraphCaptureSize": "8"},
            r"spec.remediation.levers.minCudaGraphCaptureSize must be an integer",
        ),
        ({"allowEnforceEager": "yes"}, r"spec.remediation.levers.allowEnforceEager must be true or false"),
    ):
        with pytest.raises(SpecError, match=needle):
            spec_with(remediation={"levers": bad})


def test_the_termination_message_carries_the_phase_to_the_operator() -> None:
    def pod(message: str) -> dict[str, Any]:
        return {
            "metadata": {"name": "p", "uid": "u"},
            "status": {"containerStatuses": [{"name": "vllm", "restartCount": 1, "lastState": {
                "terminated": {"exitCode": 1, "reason": "Error", "message": message}}}]},
        }  # fmt: skip

    msg = tm.TerminationMessage(reason=tm.CUDA_OOM, exit_code=1, rank=0, phase=tm.PHASE_CUDA_GRAPHS).to_json()
    (t,) = terminations(pod(msg))
    assert (t.kind, t.phase) == ("CUDAOutOfMemory", "cuda-graph-capture")
    newer = json.loads(msg) | {"phase": "some-later-phase"}
    (t,) = terminations(pod(json.dumps(newer)))
    assert (t.kind, t.phase) == ("CUDAOutOfMemory", None)  # a phase this operator does not know: unknown
