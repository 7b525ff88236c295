"""The fake vLLM's start-up lines that differ by release, and 0.34's sizing after warm-up.

* Phase markers. vLLM 0.33's V1 GPU model runner (gpu_model_runner.py) logged "Starting to load
  model" and the capture's torch-profiler line; 0.34 removed it: its V2 runner
  (vllm/v1/worker/gpu/model_runner.py) logs "Loading model from scratch...", "Model loading took"
  and "Graph capturing finished", and the capture starts with tqdm's progress bar "Capturing CUDA
  graphs (<mode>)" on the global first rank (vllm/v1/worker/gpu/cudagraph_utils.py). Which ones
  the played release has is its snapshot's (`vllm_snapshot.has`).
* The per-worker memory report after capture (both releases print it when they profiled).
* vLLM 0.34's extensible KV cache (physics/engine_measured.py): a node whose driver lacks virtual
  memory management makes the engine core fall back (`fall_back`, the `extensible_kv_disabled`
  warning; across a multi-node group, any node's lack turns it off everywhere); otherwise, after
  the sampler warm-up, each worker measures and prints "Memory after warmup …" (and, where an
  explicit utilisation withholds ≥ 1 GiB, vLLM's warning), the engine core takes the minimum over
  every rank of every node, the workers commit it ("Extended KV cache to …") and the engine core
  logs "GPU KV cache size: …" then (`after_warmup`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rankguard_sim.fake_vllm.console import RUNNER
from rankguard_sim.physics.engine_config import EngineConfig, cudagraph_capture_sizes
from rankguard_sim.physics.engine_measured import MeasuredEngineModel
from rankguard_sim.physics.engine_memory import EngineMemoryModel, KVPlan
from rankguard_sim.physics.extensible_kv import WarmupMeasurement
from rankguard_sim.vllm_snapshot import extensible_facts, format_gib, has, message, where

if TYPE_CHECKING:
    from rankguard_sim.fake_vllm.main import FakeVllm

V1_RUNNER = RUNNER  # 0.33's (the snapshot also has the V2 runner's lines)
V2_RUNNER = "gpu/model_runner.py"  # 0.34's only GPU runner
ENGINE_CORE = "EngineCore_DP0"
# What CUDA's driver answers a VMM reservation on a driver without virtual memory management
# (cuMemAddressReserve: CUDA_ERROR_NOT_SUPPORTED), which vLLM's vmm_unavailable_reason passes on
# as the reason ("GPU driver error {result}: {error string}", vllm/utils/vmm_driver.py).
NO_VMM_REASON = "GPU driver error 801: operation not supported"
CAPTURE_MODE = "PIECEWISE"  # the first mode vLLM's default FULL_AND_PIECEWISE captures


def v1_runner() -> bool:
    """Whether the played release runs 0.33's V1 GPU model runner, whose "Model loading took" and
    "Graph capturing finished" are info_once (once per node); 0.34's V2 runner logs both on every
    worker (vllm/v1/worker/gpu/model_runner.py)."""
    return has("model_load_start")


def runner() -> str:
    """The model runner file whose lines the played release prints."""
    return V1_RUNNER if v1_runner() else V2_RUNNER


def load_start_lines(fake: FakeVllm) -> None:
    """The weights' phase begins (wire/phases.py): each node's local rank 0 says so."""
    for _, who in fake.workers(once=True):
        if has("model_load_start"):
            text = message("model_load_start", fake.args.model_tag, file_suffix=V1_RUNNER)
            fake.console.info(who, where("model_load_start", V1_RUNNER), text)
        else:
            fake.console.info(who, where("model_load_start_v2", V2_RUNNER), message("model_load_start_v2"))


def capture_start_lines(fake: FakeVllm) -> None:
    """The capture begins: 0.33's profiler line per node, or 0.34's progress bar (global rank 0)."""
    if has("cuda_graph_capture_untraced"):
        for rank, who in fake.workers(once=True):
            text = message("cuda_graph_capture_untraced", fake.engine.device(rank))
            fake.console.info(who, where("cuda_graph_capture_untraced"), text)
        return
    first = [who for rank, who in fake.workers() if rank == 0]
    if has("cuda_graph_capture_bar") and first:
        bar = message("cuda_graph_capture_bar", CAPTURE_MODE)
        c = fake.config
        n = len(cudagraph_capture_sizes(c.max_num_seqs, c.max_num_batched_tokens, None))
        # tqdm on the worker's stderr, which vLLM's multiproc executor prefixes with the worker
        fake.console.plain(f"({first[0]} pid={fake.console.pid}) {bar}: 100%|##########| {n}/{n}", error=True)


def print_memory_reports(fake: FakeVllm) -> None:
    """After graph capture, each worker's memory report and graph-pool line (utilisation only).

    vLLM's gpu_worker.py prints both only when it profiled (no --kv-cache-memory-bytes);
    the graph-pool comparison only when it estimated graphs (not --enforce-eager). The
    fake's estimate is exact, so the difference is 0.
    """
    for rank, who in fake.workers():
        report = fake.engine.memory_report(rank)
        if report is None:
            continue
        if report.cuda_graph > 0:
            actual = round(report.cuda_graph / 2**30, 2)
            fake.console.info(
                who, where("cuda_graph_pool"), message("cuda_graph_pool", actual, actual, 0.0, 0.0)
            )
        fake.console.info(
            who,
            where("worker_memory_report"),
            message(
                "worker_memory_report",
                format_gib(report.init_free),
                format_gib(report.total),
                report.utilization,
                format_gib(report.requested),
                format_gib(report.total_consumed),
                format_gib(report.peak_activation),
                format_gib(report.cuda_graph),
                report.kv_to_requested_limit,
                format_gib(report.kv_to_requested_limit),
                report.kv_to_gpu_limit,
                format_gib(report.kv_to_gpu_limit),
                format_gib(report.available_kv),
            ),
        )


def kv_cache_size_line(fake: FakeVllm, plan: KVPlan) -> None:
    """The engine core's one line: pool name ("GPU" on CUDA), tokens, length, concurrency."""
    if fake.core:
        text = message(
            "kv_cache_size", "GPU", f"{plan.num_tokens:,}", f"{plan.max_model_len:,}", plan.max_concurrency
        )
        fake.console.info(ENGINE_CORE, where("kv_cache_size"), text)


# ---------------------------------------------------------------------------------------------
# 0.34's extensible KV cache


def measured(fake: FakeVllm) -> MeasuredEngineModel | None:
    return fake.engine if isinstance(fake.engine, MeasuredEngineModel) else None


def fall_back(fake: FakeVllm, world_vmm: bool) -> None:
    """`_initialize_kv_caches`: without VMM on some rank the engine core turns the mode off on
    every worker, which size the cache from the profile's estimate again; requested is resolved
    anew (0.92 unless given) and now refused when the snapshot's free memory is below it."""
    engine = measured(fake)
    facts = extensible_facts()
    if engine is None or world_vmm or facts is None:
        return
    if fake.core:
        text = message("extensible_kv_disabled", NO_VMM_REASON)
        fake.console.warning(ENGINE_CORE, where("extensible_kv_disabled"), text)
    util = fake.config.explicit_utilization
    config: EngineConfig = dataclasses.replace(
        fake.config,
        extensible_kv_cache=False,
        gpu_memory_utilization=float(facts["estimate_default_utilization"]) if util is None else util,
    )
    ranks = [m.rank for m in engine.ranks]
    plain = EngineMemoryModel(fake.scenario, config, engine.ledger, ranks)
    plain.snapshot_free = list(engine.snapshot_free)
    plain.check_requested()
    fake.config, fake.engine = config, plain


async def after_warmup(fake: FakeVllm, engine: MeasuredEngineModel) -> KVPlan:
    """Measure, settle the minimum over the world, commit it; vLLM's lines on the way."""
    found = engine.measure()
    for m in found:
        warmup_lines(fake, m)
    if fake.group is None:
        plan = engine.finalize([m.blocks for m in found])
    else:
        plan = await fake.group.settle_blocks(fake, [m.blocks for m in found])
    engine.extend()
    for held in engine.ranks:
        nbytes = plan.kv_bytes[held.rank]
        fake.console.info(
            _worker(fake, held.rank),
            where("extensible_kv_extended"),
            message("extensible_kv_extended", plan.num_gpu_blocks, nbytes / (1 << 30)),
        )
    kv_cache_size_line(fake, plan)
    return plan


def _worker(fake: FakeVllm, rank: int) -> str:
    return dict(fake.workers())[rank]


def warmup_lines(fake: FakeVllm, m: WarmupMeasurement) -> None:
    """One worker's "Memory after warmup" line, after vLLM's utilisation warning when it warns."""
    engine = measured(fake)
    who = _worker(fake, m.rank)
    if engine is not None and m.warns(engine.facts):
        text = message(
            "utilization_withholds",
            fake.config.explicit_utilization,
            format_gib(m.requested_bytes),
            format_gib(m.withheld_bytes or 0),
        )
        fake.console.warning(who, where("utilization_withholds"), text)
    text = message(
        "memory_after_warmup",
        format_gib(m.free_bytes),
        format_gib(m.committed_bytes),
        format_gib(m.kept_bytes),
        format_gib(m.peak_bytes),
        format_gib(m.torch_growth_bytes),
        m.blocks,
        format_gib(m.blocks_bytes),
        format_gib(m.requested_bytes),
        format_gib(m.torch_cap_bytes),
    )
    fake.console.info(who, where("memory_after_warmup"), text)
