"""Benchmark of the long-running agent: RSS, CPU at 10 Hz with 8 ranks, endpoint latency.

Starts the real `python -m rankguard_agent serve --backend sim` over a temporary simulated
GPU root, lets it sample idle for a while (CPU from /proc/<pid>/stat), then times /report
and /metrics with a real aiohttp client. Linux only (reads /proc).

    PYTHONPATH=agent python bench/agent_bench.py [--ranks 8] [--hz 10] [--seconds 30] [--requests 500]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from rankguard_agent.gpu.simfiles import write_device, write_proc

GIB = 1 << 30
AGENT_ROOT = Path(__file__).resolve().parents[1] / "agent"
TARGET_CPU_PERCENT = 1.0
TARGET_RSS_MIB = 60.0


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of the process (the sampler is a thread), in seconds.

    schedstat counts nanoseconds; stat's utime/stime count 10 ms ticks, too coarse for a
    process that should use a fraction of a percent.
    """
    total_ns = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total_ns += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just ended
    return total_ns / 1e9


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for pid {pid}")


def build_world(root: Path, ranks: int) -> dict[str, str]:
    uuids = []
    for i in range(ranks):
        uuid = f"GPU-bench-{i:02d}"
        write_device(root, uuid, index=i, total_bytes=80 * GIB, reserved_bytes=GIB // 2, comm_init_bytes=GIB)
        # Two live allocations per GPU, as a vLLM worker and its CUDA-graph pool would hold.
        write_proc(root, uuid, "vllm", 60 * GIB)
        write_proc(root, uuid, "graphs", GIB)
        uuids.append(uuid)
    env = dict(os.environ)
    env.update(
        {
            "RANKGUARD_SIM_GPU_ROOT": str(root),
            "NVIDIA_VISIBLE_DEVICES": ",".join(uuids),
            "PYTHONPATH": str(AGENT_ROOT),
            "RANKGUARD_AGENT_LOG_LEVEL": "INFO",
        }
    )
    return env


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def latency(url: str, n: int) -> list[float]:
    out = []
    async with aiohttp.ClientSession() as s:
        for _ in range(10):  # warm the connection and the handlers
            async with s.get(url) as r:
                await r.read()
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.get(url) as r:
                await r.read()
                assert r.status == 200
            out.append((time.perf_counter() - t0) * 1000)
    return out


async def samples_total(base: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    found = re.search(r"^rankguard_agent_samples_total (\S+)$", text, re.M)
    if found is None:
        raise RuntimeError("no rankguard_agent_samples_total in /metrics")
    return float(found.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--hz", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=30.0, help="idle sampling time measured for CPU")
    ap.add_argument("--requests", type=int, default=500, help="requests per endpoint")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="rankguard-bench-") as tmp:
        env = build_world(Path(tmp), args.ranks)
        cmd = [sys.executable, "-m", "rankguard_agent", "serve", "--backend", "sim", "--host", "127.0.0.1",
               "--port", "0", "--hz", str(args.hz)]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stderr is not None
            port = None
            while port is None:
                line = proc.stderr.readline()
                if not line:
                    raise RuntimeError("the agent exited before serving")
                found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
                port = int(found.group(1)) if found else None
            base = f"http://127.0.0.1:{port}"
            time.sleep(3.0)  # past start-up: imports and first samples are not steady state

            s0, c0, t0 = asyncio.run(samples_total(base)), cpu_seconds(proc.pid), time.monotonic()
            time.sleep(args.seconds)
            c1, t1 = cpu_seconds(proc.pid), time.monotonic()
            s1 = asyncio.run(samples_total(base))
            idle_cpu = 100 * (c1 - c0) / (t1 - t0)
            rate = (s1 - s0) / (t1 - t0)  # per-rank readings per second, all ranks together
            rss_idle = rss_mib(proc.pid)

            report_ms = asyncio.run(latency(base + "/report", args.requests))
            metrics_ms = asyncio.run(latency(base + "/metrics", args.requests))
            rss_after, rss_peak = rss_mib(proc.pid), rss_mib(proc.pid, "VmHWM")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def verdict(ok: bool, over: str) -> str:
        return "ok" if ok else over

    p50r, p99r = percentile(report_ms, 0.5), percentile(report_ms, 0.99)
    p50m, p99m = percentile(metrics_ms, 0.5), percentile(metrics_ms, 0.99)
    cpu_ok = verdict(idle_cpu < TARGET_CPU_PERCENT, f"over {TARGET_CPU_PERCENT:g} %")
    rows = [
        ("ranks x rate", f"{args.ranks} x {args.hz:g} Hz", f"{rate:.1f} readings/s measured", ""),
        ("CPU while sampling", f"{idle_cpu:.2f} % of one core", f"over {args.seconds:g} s", cpu_ok),
        ("RSS while sampling", f"{rss_idle:.1f} MiB", "", verdict(rss_idle < TARGET_RSS_MIB, "over 60 MiB")),
        (
            "RSS after requests",
            f"{rss_after:.1f} MiB",
            f"peak {rss_peak:.1f} MiB",
            verdict(rss_peak < TARGET_RSS_MIB, "over 60 MiB"),
        ),
        ("/report latency", f"p50 {p50r:.2f} ms", f"p99 {p99r:.2f} ms", f"{len(report_ms)} requests"),
        ("/metrics latency", f"p50 {p50m:.2f} ms", f"p99 {p99m:.2f} ms", f"{len(metrics_ms)} requests"),
    ]
    print(f"agent benchmark (python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    print(f"| {'measure':<20} | {'value':<24} | {'detail':<30} | {'target':<14} |")
    print(f"|{'-' * 22}|{'-' * 26}|{'-' * 32}|{'-' * 16}|")
    for name, value, detail, target in rows:
        print(f"| {name:<20} | {value:<24} | {detail:<30} | {target:<14} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
