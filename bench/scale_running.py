"""Running mode of bench/operator_scale.py (`--running`, issue 31): every service's pod Running
and Ready, each answered by a real agent app (scale_agents.py).

Per N, on a fresh control plane as in the Pending mode: the agents start first (one address
per pod, 127.1.x.y, the services' agent port), the N TP8 LLMServices are created and time to
status is measured, then the bench plays the kubelet for every pod (scale_cohort.run_pod on
its GPU-less fake node) and waits until every service's status shows all its ranks. After
`--settle` seconds (a fixed wait: with drifting figures the status need never go quiet) the
steady window measures, besides the Pending mode's CPU, RSS and API requests:

- status writes per service per minute: the operator's `patch llmservices/status` in the audit log;
- step passes per service per minute: each service's `rankguard_operator_passes_total` and
  `rankguard_operator_last_pass_timestamp_seconds` from the operator's /metrics, read at the
  window's start and end: the passes after the last one the first read saw, over the time from
  that pass to the last one the second read saw (`pass_rate`). A count over the window's own
  length is biased by where the reads fall: when the services still resynced in one burst (they
  started together), both of the window's ends sat in one and it read 2.02;
- the services' last passes in their busiest second (`busiest_second`): the whole cohort if
  they resync in one burst, about N / 30 when each keeps its own moment in the interval;

- the agents' /report answers per second and their CPU (every agent process, /proc).

With `--restart` the operator is restarted once every rank is in status, so the settle and the
window follow every service's loop starting at the same moment (an upgrade, a failover).

Then the spec -> status lag (as the Pending mode), and the drop -> status lag: `--drops`
services at random, one every `--drop-every` s, get one rank's free memory cut by
`--drop-fraction` of the GPU in their agent, timed from the cut to the watch showing that
rank's `minFreeBytes` at or below the cut figure (drift included).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import platform
import random
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from rankguard_operator.core.names import LLMSERVICE_LABEL
from scale_agents import AgentFleet, running_ips
from scale_cohort import FakeNode, free_port_on, run_pod
from scale_measure import (
    ScaleResult,
    _lags,
    count_log_errors,
    cpu_seconds_per_minute,
    env_summary,
    per_service_minute,
    print_tables,
    summary_rows,
)
from scale_sandbox import BENCH_NS, Sandbox, audit_count, log, proc_sample, sandbox
from scale_services import (
    BASE_MIN_FREE,
    collect_lags,
    create_timed,
    example_template,
    service_doc,
    service_names,
    spec_lags,
)
from scale_watch import ServiceWatch

STATUS_WRITE = "patch llmservices/status"
# The Running mode's own target: a rank's drop in free memory is in status within 5 s at p99
# (the spec and report lags of the Pending mode have 15 s, scale_measure). Judged and printed
# from this one figure, so the verdict cannot disagree with the target beside it.
TARGET_DROP_LAG_P99_SECONDS = 5.0
T = TypeVar("T")

PASSES_SAMPLE = "rankguard_operator_passes_total"  # edge/metrics.PASSES, as its samples are named
LAST_PASS_SAMPLE = "rankguard_operator_last_pass_timestamp_seconds"  # edge/metrics.LAST_PASS


class RankWatch(ServiceWatch):
    """Also notes which ranks each service's status shows, and when an expected drop showed."""

    def __init__(self, api: Any, namespace: str) -> None:
        super().__init__(api, namespace)
        self.ranks_seen: dict[str, set[int]] = {}
        self._expect: dict[tuple[str, int], int] = {}  # (name, rank) -> minFreeBytes at most
        self._dropped: dict[tuple[str, int], float] = {}

    def _see(self, obj: dict[str, Any], at: float) -> None:
        super()._see(obj, at)
        name = str((obj.get("metadata") or {}).get("name"))
        with self._cond:
            for row in (obj.get("status") or {}).get("ranks") or []:
                rank, low = row.get("rank"), row.get("minFreeBytes")
                if not isinstance(rank, int) or not isinstance(low, int) or row.get("stale"):
                    continue
                self.ranks_seen.setdefault(name, set()).add(rank)
                limit = self._expect.get((name, rank))
                if limit is not None and low <= limit:
                    self._dropped.setdefault((name, rank), at)
            self._cond.notify_all()

    def expect(self, name: str, rank: int, at_most: int) -> None:
        """Before the cut: the undropped figure never gets this low, so any row that does is it."""
        with self._cond:
            self._expect[(name, rank)] = at_most

    def dropped_at(self, name: str, rank: int, deadline: float) -> float | None:
        try:
            return float(
                self.wait(f"{name} rank {rank} drop", lambda: self._dropped.get((name, rank)), deadline)
            )
        except TimeoutError:
            return None


@dataclass
class RunningExtra:
    """What only the Running mode measures, per N."""

    pods_running_seconds: float = math.nan  # binding + status of every pod
    all_ranks_seconds: float = math.nan  # first pod run -> every service shows every rank
    passes: float = math.nan  # the bench services' passes in the window (pass_rate)
    passes_seconds: float = math.nan  # service-seconds they took
    busiest_second: int = 0  # of the services' last passes in the window, most in one second
    served: int = 0  # the agents' /report answers in the window
    served_seconds: float = math.nan  # between the two reads of that count
    agents_cpu_per_minute: float = math.nan
    agents_rss_bytes: int = 0
    drop_lags: list[float] = field(default_factory=list)
    drop_missed: int = 0


PassMarks = dict[str, tuple[float, float]]  # service -> (its passes so far, its last pass's time)


def pass_marks(text: str, namespace: str) -> PassMarks:
    """Each of the namespace's services' pass count and the time its last pass finished."""
    count: dict[str, float] = {}
    last: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("namespace") != namespace:
                continue
            if s.name == PASSES_SAMPLE:
                count[s.labels.get("llmservice", "")] = s.value
            elif s.name == LAST_PASS_SAMPLE:
                last[s.labels.get("llmservice", "")] = s.value
    return {svc: (n, last[svc]) for svc, n in count.items() if svc in last}


def pass_rate(before: PassMarks, after: PassMarks) -> tuple[float, float]:
    """The passes between two reads and the service-seconds they took: per service, the passes
    after the last one `before` saw up to the last one `after` saw, over the time between those
    two passes (a service that passes every 30 s gives exactly 2 a minute, wherever the reads
    fall in its cycle). A service without a pass in between adds nothing."""
    passes = seconds = 0.0
    for svc, (n1, t1) in after.items():
        n0, t0 = before.get(svc, (n1, t1))
        if n1 > n0 and t1 > t0:
            passes, seconds = passes + (n1 - n0), seconds + (t1 - t0)
    return passes, seconds


def busiest_second(marks: PassMarks) -> int:
    """The most services whose last pass finished in the same wall-clock second. Read at the
    end of a steady window, every service's last pass is its resync in the interval before:
    the whole cohort when they resync in one burst, about N / interval when each keeps its own
    moment (core/cadence.resync_in)."""
    return max(Counter(int(t) for _, t in marks.values()).values(), default=0)


def timed(read: Callable[..., T], *args: Any) -> tuple[T, float]:
    """What `read` returned, and the monotonic time it returned at."""
    value = read(*args)
    return value, time.monotonic()


def metrics_passes(box: Sandbox) -> PassMarks:
    with urllib.request.urlopen(box.op.metrics_url, timeout=10) as r:
        return pass_marks(r.read().decode(), BENCH_NS)


def run_pods(api: Any, names: list[str], ips: list[str], *, concurrency: int, timeout: float) -> None:
    """Every service's one pod bound to the fake node and Running/Ready at its own address."""
    ip_of = dict(zip(names, ips, strict=True))
    # A service's status comes before the ReplicaSet controller has made its pod: wait for all.
    deadline = time.monotonic() + timeout
    while True:
        listed = client.CoreV1Api(api).list_namespaced_pod(BENCH_NS, label_selector=LLMSERVICE_LABEL)
        pods = [p for p in listed.items if not p.metadata.deletion_timestamp]
        by_service = {str(p.metadata.labels[LLMSERVICE_LABEL]): p for p in pods}
        if len(pods) == len(names) and set(by_service) == set(names):
            break
        if len(pods) > len(names) or time.monotonic() > deadline:
            raise RuntimeError(f"expected one serving pod per service, found {len(pods)} for {len(names)}")
        time.sleep(1.0)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(run_pod, api, BENCH_NS, by_service[n], ip_of[n]) for n in names]:
            f.result()


def agents_sample(pids: Sequence[int]) -> tuple[int, int]:
    """CPU ticks and RSS bytes of the agent processes, summed."""
    ticks = rss = 0
    for pid in pids:
        t, mem = proc_sample(pid)
        ticks, rss = ticks + t, rss + mem.get("VmRSS", 0)
    return ticks, rss


def steady(
    box: Sandbox, sw: RankWatch, fleet: AgentFleet, res: ScaleResult, ex: RunningExtra, *, window: float
) -> None:
    assert box.op.proc is not None
    pid, hz = box.op.proc.pid, os.sysconf("SC_CLK_TCK")
    offset = box.audit_log.stat().st_size
    # The agents' count is timed on its own read (over the window's nominal length, the reads'
    # own time would count answers for nothing); the passes carry their own times (pass_rate).
    passes0, (served0, smono0) = metrics_passes(box), timed(fleet.served)
    aticks0, _ = agents_sample(fleet.pids)
    ticks0, _ = proc_sample(pid)
    wall0, mono0 = time.time(), time.monotonic()
    time.sleep(window)
    ticks1, mem = proc_sample(pid)
    wall1, mono1 = time.time(), time.monotonic()
    aticks1, ex.agents_rss_bytes = agents_sample(fleet.pids)
    passes1, (served1, smono1) = metrics_passes(box), timed(fleet.served)
    res.window_seconds = mono1 - mono0
    res.cpu_per_minute = cpu_seconds_per_minute(ticks1 - ticks0, hz, res.window_seconds)
    res.rss_bytes = mem.get("VmRSS", 0)
    res.changes_seen = sw.modified_between(mono0, mono1)
    ex.passes, ex.passes_seconds = pass_rate(passes0, passes1)
    ex.busiest_second = busiest_second(passes1)
    ex.served, ex.served_seconds = served1 - served0, smono1 - smono0
    ex.agents_cpu_per_minute = cpu_seconds_per_minute(aticks1 - aticks0, hz, res.window_seconds)
    res.requests = audit_count(box, offset, wall0, wall1)


def drop_lags(
    sw: RankWatch,
    fleet: AgentFleet,
    names: list[str],
    ips: list[str],
    *,
    total: int,
    args: argparse.Namespace,
) -> tuple[list[float], int]:
    """Cut one rank's free memory in `--drops` random services' agents, one every --drop-every s."""
    rng = random.Random(args.seed + 31)
    cut = int(total * args.drop_fraction)
    drift = int(total * args.drift)
    picked = rng.sample(range(len(names)), min(args.drops, len(names)))
    changed: list[tuple[str, int, float]] = []
    for i in picked:
        rank = rng.randrange(args.tp)
        sw.expect(names[i], rank, BASE_MIN_FREE - cut + drift)
        changed.append((names[i], rank, fleet.drop(ips[i], rank, cut)))
        time.sleep(args.drop_every)
    deadline = time.monotonic() + args.lag_timeout
    return collect_lags(
        [(at, lambda n=name, r=rank: sw.dropped_at(n, r, deadline)) for name, rank, at in changed]
    )


def run_running(
    n: int, args: argparse.Namespace, operator_env: dict[str, str]
) -> tuple[ScaleResult, RunningExtra]:
    started = time.monotonic()
    res, ex = ScaleResult(services=n), RunningExtra()
    template = example_template()
    total = int(template["spec"]["memory"]["gpuMemoryBytes"])
    ips = running_ips(n)
    port = free_port_on(ips)
    names = service_names(n)
    docs = [service_doc(template, nm, args.tp, port) for nm in names]
    fleet = AgentFleet(
        ips, port, ranks=args.tp, total=total, base_free=BASE_MIN_FREE, drift=int(total * args.drift),
        hz=args.agent_hz, procs=args.agent_procs or max(1, math.ceil(n / 500)), seed=args.seed,
    )  # fmt: skip
    try:
        fleet.start()
        log(f"N={n}: {len(fleet.procs)} agent process(es) serving {n} agents on port {port}")
        with sandbox(operator_env, args.keep, metrics=True) as box:
            sw = RankWatch(box.api, BENCH_NS)
            node = FakeNode(box.api)
            sw.start()
            try:
                node.start()
                measure_running(
                    box, sw, fleet, res=res, ex=ex, names=names, ips=ips, docs=docs, total=total, args=args
                )
            finally:
                node.stop()
                sw.stop()
            assert box.op.proc is not None
            res.peak_rss_bytes = proc_sample(box.op.proc.pid)[1].get("VmHWM", 0)
            res.log_errors = count_log_errors(box.op.log.read_text(errors="replace").splitlines())
    finally:
        fleet.stop()
    res.took_seconds = time.monotonic() - started
    log(f"N={n}: done in {res.took_seconds:.0f} s")
    return res, ex


def measure_running(
    box: Sandbox,
    sw: RankWatch,
    fleet: AgentFleet,
    *,
    res: ScaleResult,
    ex: RunningExtra,
    names: list[str],
    ips: list[str],
    docs: list[dict[str, Any]],
    total: int,
    args: argparse.Namespace,
) -> None:
    n = len(names)
    create_timed(box, sw, res, docs, args)
    t1 = time.monotonic()
    run_pods(box.api, names, ips, concurrency=args.concurrency, timeout=args.timeout)
    ex.pods_running_seconds = time.monotonic() - t1
    ranks = set(range(args.tp))
    sw.wait(
        f"every rank in the status of all {n} LLMServices",
        lambda: all(ranks <= sw.ranks_seen.get(nm, set()) for nm in names),
        time.monotonic() + args.timeout,
    )
    ex.all_ranks_seconds = time.monotonic() - t1
    log(
        f"N={n}: pods Running in {ex.pods_running_seconds:.1f} s, "
        f"every rank in status after {ex.all_ranks_seconds:.1f} s"
    )
    if args.restart:  # every service's loop starts at once, as after an upgrade or a failover
        box.op.stop()
        box.op.start()
        box.op.wait_ready(timeout=args.timeout)
        log(f"N={n}: operator restarted")
    time.sleep(args.settle)  # the first passes' follow-ups; figures drift, so never "quiet"
    res.settle_seconds = args.settle
    steady(box, sw, fleet, res, ex, window=args.window)
    log(
        f"N={n}: steady window: {res.cpu_per_minute:.1f} CPU s/min, "
        f"{res.requests_per_service_minute:.2f} requests/service/min"
    )
    picked = random.Random(args.seed).sample(names, min(args.changes, n))
    res.spec_lags, res.spec_missed = spec_lags(box.api, sw, picked, args.change_every, args.lag_timeout)
    ex.drop_lags, ex.drop_missed = drop_lags(sw, fleet, names, ips, total=total, args=args)


def _per_minute(passes: float, service_seconds: float) -> str:
    return f"{passes / service_seconds * 60:.2f}" if service_seconds > 0 else "n/a"


def running_rows(results: Sequence[ScaleResult], extras: Sequence[RunningExtra]) -> list[list[str]]:
    """The Pending mode's rows (less the quiet wait, fixed here) and the Running mode's own."""
    pairs = list(zip(results, extras, strict=True))

    def rate(count: float, r: ScaleResult) -> str:
        return f"{per_service_minute(round(count), r.services, r.window_seconds):.2f}"

    drop = [_lags(e.drop_lags, e.drop_missed, TARGET_DROP_LAG_P99_SECONDS) for e in extras]
    own = [
        ["pods made Running in", *[f"{e.pods_running_seconds:.1f} s" for e in extras], ""],
        ["every rank in status after", *[f"{e.all_ranks_seconds:.1f} s" for e in extras], ""],
        [
            "status writes / service / min",
            *[rate(r.requests.get(STATUS_WRITE, 0), r) for r, _ in pairs],
            "<= 1",
        ],
        ["step passes / service / min", *[_per_minute(e.passes, e.passes_seconds) for e in extras], "<= 2"],
        [
            "last passes in their busiest second",
            *[f"{e.busiest_second} of {r.services}" for r, e in pairs],
            "",
        ],
        ["drop -> status lag p50", *[d[0] for d in drop], ""],
        ["drop -> status lag p99", *[d[1] for d in drop], f"< {TARGET_DROP_LAG_P99_SECONDS:g} s"],
        ["agents: /report answers / s", *[f"{e.served / e.served_seconds:.1f}" for e in extras], ""],
        ["agents CPU (all processes)", *[f"{e.agents_cpu_per_minute:.1f} s/min" for e in extras], ""],
        ["agents RSS (all processes)", *[f"{e.agents_rss_bytes / (1 << 20):.0f} MiB" for e in extras], ""],
    ]
    rows = [r for r in summary_rows(results) if not r[0].startswith("settled after")]
    at = next(i for i, r in enumerate(rows) if r[0] == "operator log ERROR lines")
    return rows[:at] + own + rows[at:]


def add_running_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--running", action="store_true", help="every pod Running, real agents (issue 31)")
    # 1 Hz, not the agent's 10: 8,000 ranks x 10 reads a second would swamp the bench's 2 cores.
    ap.add_argument("--agent-hz", type=float, default=1.0, help="Running: the agents' sampler rate")
    ap.add_argument("--agent-procs", type=int, default=0, help="Running: agent processes (0: 1 per 500)")
    ap.add_argument("--drift", type=float, default=0.002, help="Running: free memory drift, share of the GPU")
    ap.add_argument("--drops", type=int, default=20, help="Running: headroom drops timed to status")
    ap.add_argument("--drop-every", type=float, default=1.5, help="Running: seconds between two drops")
    ap.add_argument("--drop-fraction", type=float, default=0.05, help="Running: a drop, share of the GPU")
    ap.add_argument(
        "--restart", action="store_true", help="Running: restart the operator before the settle and window"
    )


def main_running(args: argparse.Namespace, counts: list[int], operator_env: dict[str, str]) -> int:
    if args.multi_node:
        raise SystemExit("--running serves one pod per service: no --multi-node")
    done: list[tuple[ScaleResult, RunningExtra]] = []
    failed: str | None = None
    for n in counts:
        try:
            done.append(run_running(n, args, operator_env))
        except Exception as e:  # a setup failure: report what ran, exit non-zero
            failed = f"N={n}: {type(e).__name__}: {e}"
            log(failed)
            break
    if done:
        results, extras = [r for r, _ in done], [e for _, e in done]
        title = (
            f"operator at scale, Running: TP{args.tp} LLMServices, every pod Running/Ready on a fake "
            f"node, real agent apps (synthetic GPUs, drift +-{args.drift:.1%}, "
            f"sampler {args.agent_hz:g} Hz); "
            f"window {args.window:g} s after {args.settle:g} s"
            f"{' and an operator restart' if args.restart else ''}; "
            f"operator env {env_summary(operator_env)}; "
            f"python {platform.python_version()}, {os.cpu_count()} CPUs"
        )
        print_tables(title, running_rows(results, extras), results, args.verbose)
    if failed:
        print(f"setup failed: {failed}", file=sys.stderr)
        return 1
    return 0
