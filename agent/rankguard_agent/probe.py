"""The startup probe: what communicator init really costs on each rank of this pod.

One process per rank joins a torch.distributed group (NCCL on GPUs, gloo on CPU), runs
warm-up collectives sized like the model's (an all-reduce of hidden-size activations, an
all-gather of vocab-sharded logits), and records free memory before and after. Then every
process exits, which releases every GPU byte before the engine starts.

torch is imported only inside the rank processes (`_worker`), never by the long-running
agent. The parent only spawns, waits and collects: a rank that fails is reported, and the
others (blocked in a rendezvous or a collective with the dead rank) are killed after a
short grace, so the probe cannot hang. An overall deadline bounds everything else.

Each rank holds its GPU backend's `communicator_init` around init and warm-up: nothing on
real GPUs (NCCL allocates by itself), the world's communicator cost on simulated ones,
which is why a CPU (gloo) probe needs a simulated backend to measure anything.

The probe runs over the pod's own GPUs (local ranks 0..world_size-1, its own group). On a pod of
a vLLM multi-node group (`place`) its results name each rank by vLLM's global rank, with the
local one beside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rankguard_agent.gpu import GpuBackend, GpuUnavailable, open_backend, release_communicators
from rankguard_agent.wire.group import MAX_RANKS, SINGLE_NODE, GroupPlace
from rankguard_agent.wire.report import ProbeRank, ProbeResult

log = logging.getLogger("rankguard_agent.probe")

_POLL_SECONDS = 0.05
_LOG_TAIL_CHARS = 400


@dataclass(frozen=True)
class ProbeConfig:
    world_size: int  # 0: one rank per GPU the backend sees (resolved by the caller)
    device: str = "auto"  # "cuda", "cpu", or "auto" (cuda when torch sees one)
    hidden_size: int = 4096
    vocab_size: int = 32000
    tokens: int = 512  # rows of the warm-up all-reduce: one prefill chunk
    batch: int = 256  # rows of the warm-up logits all-gather: max_num_seqs
    max_elements: int = 0  # cap per collective; 0 means 64 Mi on GPU, 256 Ki on CPU
    timeout_s: float = 300.0  # the whole probe; NCCL init on 8 GPUs takes tens of seconds
    failure_grace_s: float = 3.0  # how long survivors get after a rank fails
    gpu_backend: str = "auto"  # where free memory is read: auto|nvml|sim (torch as fallback)
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.world_size <= MAX_RANKS:
            raise ValueError(f"world_size must be within 0..{MAX_RANKS} (0: one per visible GPU)")
        if min(self.hidden_size, self.vocab_size, self.tokens, self.batch) < 1:
            raise ValueError("hidden_size, vocab_size, tokens and batch must be positive")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")


def model_shape_from_config(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(hidden_size, vocab_size) from a Hugging Face config.json (text_config for VLMs)."""
    doc = json.loads(Path(path).read_text())
    if isinstance(doc.get("text_config"), dict) and "hidden_size" not in doc:
        doc = doc["text_config"]
    hidden, vocab = doc.get("hidden_size"), doc.get("vocab_size")
    if not isinstance(hidden, int) or not isinstance(vocab, int) or hidden < 1 or vocab < 1:
        raise ValueError(f"{path}: no positive integer hidden_size and vocab_size")
    return hidden, vocab


def warmup_shapes(cfg: ProbeConfig, world_size: int, on_gpu: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of the all-reduce (tokens x hidden) and of each rank's logits shard (batch x vocab/tp).

    Rows are cut to stay under the element cap, so a CPU test moves about a megabyte.
    """
    cap = cfg.max_elements or ((64 << 20) if on_gpu else (256 << 10))
    hidden = min(cfg.hidden_size, cap)
    reduce_rows = max(1, min(cfg.tokens, cap // hidden))
    shard = max(1, -(-cfg.vocab_size // world_size))
    shard = min(shard, cap)
    gather_rows = max(1, min(cfg.batch, cap // (shard * world_size)))
    return (reduce_rows, hidden), (gather_rows, shard)


# -- the parent ----------------------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    result_path: Path
    result: dict[str, Any] | None = None
    error: str | None = None
    done: bool = False


def _agent_path() -> str:
    return str(Path(__file__).resolve().parent.parent)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Terminate the rank's whole session (NCCL may have spawned helpers), then reap it."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path) -> str:
    try:
        text = path.read_bytes()[-4096:].decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][-_LOG_TAIL_CHARS:] if lines else ""


def run_probe(
    cfg: ProbeConfig,
    env: Mapping[str, str] | None = None,
    cancel: threading.Event | None = None,
    place: GroupPlace = SINGLE_NODE,
) -> ProbeResult:
    """Run the probe to completion (bounded by cfg.timeout_s, or until `cancel` is set).

    Never raises for rank failures: they are in the result. `place`: the pod's place in a
    multi-node group, which names the results' ranks (global) and nothing else.
    """
    if cfg.world_size < 1:
        raise ValueError("run_probe needs world_size >= 1; resolve 0 to the number of GPUs first")
    started = time.monotonic()
    base_env = dict(os.environ if env is None else env)
    base_env.update(cfg.extra_env)
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in (_agent_path(), base_env.get("PYTHONPATH", "")) if p)
    workdir = Path(tempfile.mkdtemp(prefix="rankguard-probe-"))
    ranks: list[_Rank] = []
    backend = "nccl" if cfg.device == "cuda" else ("gloo" if cfg.device == "cpu" else "")
    try:
        spec = json.dumps({"cfg": asdict(cfg), "workdir": str(workdir)})
        for r in range(cfg.world_size):
            log_path = workdir / f"rank-{r}.log"
            with open(log_path, "wb") as logf:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "rankguard_agent.probe", "worker", str(r), spec],
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    env=base_env,
                    start_new_session=True,
                )
            ranks.append(_Rank(r, proc, log_path, workdir / f"rank-{r}.json"))
        error = _wait(ranks, cfg, started, cancel, place)
    finally:
        for rk in ranks:
            _kill(rk.proc)
        release_communicators(base_env, [rk.proc.pid for rk in ranks])  # what killed ranks still held
        shutil.rmtree(workdir, ignore_errors=True)
    probe_ranks = []
    for rk in ranks:
        res = rk.result or {}
        backend = backend or str(res.get("backend", ""))
        probe_ranks.append(
            ProbeRank(
                rank=place.global_rank(rk.rank),
                free_before_bytes=int(res.get("free_before_bytes", 0)),
                free_after_bytes=int(res.get("free_after_bytes", 0)),
                comm_bytes=int(res.get("comm_bytes", 0)),
                error=rk.error,
                local_rank=rk.rank if place.multi_node else None,
            )
        )
    ok = error is None and all(p.error is None for p in probe_ranks)
    if not ok and error is None:
        first = [p for p in probe_ranks if p.error is not None and not p.error.startswith("aborted")]
        culprit = first[0] if first else next(p for p in probe_ranks if p.error is not None)
        error = f"rank {culprit.rank} failed: {culprit.error}"[:1000]
    return ProbeResult(
        ok=ok,
        backend=backend or "unknown",
        world_size=cfg.world_size,
        ranks=probe_ranks,
        error=error,
        duration_seconds=round(time.monotonic() - started, 3),
    )


def probe_pod(
    cfg: ProbeConfig,
    n_ranks: int,
    env: Mapping[str, str],
    cancel: threading.Event,
    place: GroupPlace = SINGLE_NODE,
) -> ProbeResult:
    """The launcher's probe: over the pod's `n_ranks` GPUs when `cfg.world_size` is 0, and in a
    multi-node group over no more than the ranks vLLM runs on each pod (a GPU beyond them would
    take another pod's global rank). Logs what it does and what it found."""
    if cfg.world_size == 0:
        if n_ranks == 0:
            return ProbeResult(ok=False, backend="none", world_size=0, error="no GPUs visible to probe")
        cfg = replace(cfg, world_size=n_ranks)
    if place.multi_node and cfg.world_size > place.local_world:
        log.warning(
            "probing %d rank(s), the pod's share of the group, not %d", place.local_world, cfg.world_size
        )
        cfg = replace(cfg, world_size=place.local_world)
    first, last = place.global_rank(0), place.global_rank(cfg.world_size - 1)
    log.info(
        "probing %d rank(s)%s", cfg.world_size, f": global ranks {first}..{last}" if place.multi_node else ""
    )
    result = run_probe(cfg, env, cancel, place)
    if result.ok:
        log.info("probe ok in %.1fs: %s", result.duration_seconds, [r.comm_bytes for r in result.ranks])
    else:
        log.error("probe failed: %s", result.error)
    return result


def _collect(rk: _Rank) -> None:
    """Read a finished rank's result file; a crash without one is reported from its log."""
    rk.done = True
    try:
        rk.result = json.loads(rk.result_path.read_text())
    except (OSError, ValueError):
        rk.result = None
    code = rk.proc.returncode
    if rk.result is not None and rk.result.get("error"):
        rk.error = str(rk.result["error"])[:1000]
    elif code != 0 or rk.result is None:
        tail = _tail(rk.log_path)
        rk.error = f"exited with code {code}" + (f": {tail}" if tail else "")


def _abandon(rk: _Rank, template: str) -> None:
    """A rank we had to kill: keep what it measured before, and say where it was stuck."""
    rk.done = True
    try:
        rk.result = json.loads(rk.result_path.read_text())
    except (OSError, ValueError):
        rk.result = None
    stage = str((rk.result or {}).get("stage", "startup"))
    rk.error = template.format(stage=stage)


def _wait(
    ranks: list[_Rank], cfg: ProbeConfig, started: float, cancel: threading.Event | None, place: GroupPlace
) -> str | None:
    deadline = started + cfg.timeout_s
    first_failure: tuple[float, int] | None = None
    while True:
        for rk in ranks:
            if not rk.done and rk.proc.poll() is not None:
                _collect(rk)
                if rk.error is not None and first_failure is None:
                    first_failure = (time.monotonic(), rk.rank)
        pending = [rk for rk in ranks if not rk.done]
        if not pending:
            return None
        now = time.monotonic()
        if first_failure is not None and now - first_failure[0] >= cfg.failure_grace_s:
            # The survivors wait for a peer that will never come: stop them now.
            for rk in pending:
                _kill(rk.proc)
                _abandon(rk, f"aborted in {{stage}}: rank {place.global_rank(first_failure[1])} failed")
            return None
        if cancel is not None and cancel.is_set():
            for rk in pending:
                _kill(rk.proc)
                _abandon(rk, "cancelled in {stage}")
            return "probe cancelled"
        if now >= deadline:
            for rk in pending:
                _kill(rk.proc)
                _abandon(rk, f"timed out after {cfg.timeout_s:g}s in {{stage}}")
            return f"probe timed out after {cfg.timeout_s:g}s"
        time.sleep(_POLL_SECONDS)


# -- one rank (a separate process; the only place torch is imported) -------------------------


class _Reader:
    """Free memory of this rank's GPU from the agent's backend, or from torch as a fallback."""

    def __init__(self, kind: str, rank: int, on_gpu: bool) -> None:
        self.rank = rank
        self.backend: GpuBackend | None = None
        self.on_gpu = on_gpu
        try:
            self.backend = open_backend(kind, os.environ)
        except GpuUnavailable as e:
            if not on_gpu:
                raise RuntimeError(f"no memory source for a CPU probe: {e}") from None
        if self.backend is not None and rank >= len(self.backend.ranks()):
            if not on_gpu:
                raise RuntimeError(f"rank {rank} has no GPU in the {self.backend.name} backend")
            self.backend = None

    def free(self) -> int | None:
        if self.backend is None:
            return None
        reading = self.backend.read(self.rank)
        if reading.error is not None:
            raise RuntimeError(f"reading rank {self.rank}'s GPU failed: {reading.error}")
        return int(reading.free_bytes)


def _write_result(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _worker(rank: int, spec: dict[str, Any]) -> int:
    from datetime import timedelta  # noqa: PLC0415

    import torch  # noqa: PLC0415 - the probe alone pays for torch
    import torch.distributed as dist  # noqa: PLC0415

    fields = dict(spec["cfg"])
    cfg = ProbeConfig(**fields)
    workdir = Path(spec["workdir"])
    on_gpu = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    backend = "nccl" if on_gpu else "gloo"
    result: dict[str, Any] = {"rank": rank, "backend": backend, "error": None}
    held = contextlib.ExitStack()
    try:
        reader = _Reader(cfg.gpu_backend, rank, on_gpu)
        # Read before this process touches CUDA: the context is part of what init costs.
        before = reader.free()
        if on_gpu:
            torch.cuda.set_device(rank)
            if before is None:
                reader.backend = None
                before = int(torch.cuda.mem_get_info()[0])
        elif reader.backend is None or not reader.backend.simulated:
            raise RuntimeError("a CPU probe reads memory from the sim backend")
        if reader.backend is not None:
            held.enter_context(reader.backend.communicator_init(rank))
        if before is None:
            raise RuntimeError(f"no free-memory reading for rank {rank}")
        result["free_before_bytes"] = before
        result["stage"] = "init_process_group"
        _write_result(workdir / f"rank-{rank}.json", result)  # what survives if we are killed
        kwargs: dict[str, Any] = {}
        if on_gpu:
            kwargs["device_id"] = torch.device("cuda", rank)  # create the communicator now
        dist.init_process_group(
            backend,
            init_method=(workdir / "rendezvous").as_uri(),
            rank=rank,
            world_size=cfg.world_size,
            timeout=timedelta(seconds=cfg.timeout_s),
            **kwargs,
        )
        (rows, hidden), (grows, shard) = warmup_shapes(cfg, cfg.world_size, on_gpu)
        device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
        dtype = torch.bfloat16 if on_gpu else torch.float32
        act = torch.ones((rows, hidden), dtype=dtype, device=device)
        dist.all_reduce(act)
        if float(act[0, 0]) != float(cfg.world_size):
            raise RuntimeError(f"all_reduce returned {float(act[0, 0])}, expected {cfg.world_size}")
        logits = torch.full((grows, shard), float(rank), dtype=dtype, device=device)
        gathered = [torch.empty_like(logits) for _ in range(cfg.world_size)]
        dist.all_gather(gathered, logits)
        if [int(g[0, 0]) for g in gathered] != list(range(cfg.world_size)):
            raise RuntimeError("all_gather returned shards out of order")
        del act, logits, gathered
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # warm-up tensors are not a cost the engine will pay
        after = reader.free()
        if after is None:
            after = int(torch.cuda.mem_get_info()[0])
        result["free_after_bytes"] = after
        result["comm_bytes"] = before - after
        result["stage"] = "destroy_process_group"
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[:1000]
    else:
        result.pop("stage", None)
    finally:
        held.close()  # the communicator's memory goes back on every path, failures included
        _write_result(workdir / f"rank-{rank}.json", result)
    return 0 if result["error"] is None else 1


def _worker_main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "worker":
        print("usage: python -m rankguard_agent.probe worker RANK SPEC_JSON", file=sys.stderr)
        return 2
    if os.environ.get("GLOO_SOCKET_IFNAME") is None:
        # The pod's hostname may not resolve to a usable interface; ranks are all local.
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    return _worker(int(argv[1]), json.loads(argv[2]))


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
