"""The LLMServices of bench/operator_scale.py, as both its modes (Pending, and Running:
scale_running.py) make and time them: the example's document, the bench's copies of it, their
creation and the time to every first status, and the spec -> status lag.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import os
import time
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from rankguard_operator.core.names import API_GROUP, API_VERSION, PLURAL
from scale_measure import MIB, ScaleResult
from scale_sandbox import BENCH_NS, REPO, Sandbox, audit_count, log, proc_sample
from scale_watch import ServiceWatch

EXAMPLE = REPO / "examples" / "llama3-70b-tp4.yaml"
# Each rank's free memory as the bench's agents first report it: ample, no policy rule acts on it.
BASE_MIN_FREE = 6 * 1024 * MIB


def example_template() -> dict[str, Any]:
    """The example's LLMService, which every service of the bench copies."""
    return next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d and d.get("kind") == "LLMService")


def service_names(n: int) -> list[str]:
    return [f"svc-{i:04d}" for i in range(n)]


def service_doc(
    template: dict[str, Any], name: str, tp: int, agent_port: int | None, *, multi_node: bool = False
) -> dict[str, Any]:
    doc = copy.deepcopy(template)
    doc["metadata"] = {"name": name}
    doc["spec"]["tensorParallelSize"] = tp
    if multi_node:  # TP×PP 2 over two pods: two StatefulSets and a headless Service more
        doc["spec"]["pipelineParallelSize"] = 2
        doc["spec"]["distributed"] = {"podsPerGroup": 2}
    if agent_port is not None:  # the cohort's fake agents listen on a port free on this machine
        doc["spec"].setdefault("agent", {})["port"] = agent_port
    return doc


def create_all(api: Any, docs: list[dict[str, Any]], concurrency: int) -> None:
    custom = client.CustomObjectsApi(api)

    def create(doc: dict[str, Any]) -> None:
        for attempt in range(5):
            try:
                custom.create_namespaced_custom_object(API_GROUP, API_VERSION, BENCH_NS, PLURAL, doc)
                return
            except ApiException as e:
                if e.status == 409 and attempt:  # a retry of a create that went through
                    return
                if e.status not in (429, 500, 503, 504) or attempt == 4:
                    raise
            time.sleep(0.5 * (attempt + 1))

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(create, d) for d in docs]:
            f.result()


def create_timed(
    box: Sandbox, sw: ServiceWatch, res: ScaleResult, docs: list[dict[str, Any]], args: argparse.Namespace
) -> None:
    """Create the services and time their first status (and what reaching it cost)."""
    names = [str(d["metadata"]["name"]) for d in docs]
    assert box.op.proc is not None
    offset, ticks0 = box.audit_log.stat().st_size, proc_sample(box.op.proc.pid)[0]
    wall0, t0 = time.time(), time.monotonic()
    create_all(box.api, docs, args.concurrency)
    res.create_seconds = time.monotonic() - t0
    res.status_seconds = sw.all_synced(names, t0 + args.timeout) - t0
    res.create_cpu_seconds = (proc_sample(box.op.proc.pid)[0] - ticks0) / os.sysconf("SC_CLK_TCK")
    res.create_requests = audit_count(box, offset, wall0, wall0 + res.status_seconds)
    took = f"created in {res.create_seconds:.1f} s, all have status after {res.status_seconds:.1f} s"
    log(f"N={len(names)}: {took}")


def spec_lags(
    api: Any, sw: ServiceWatch, names: list[str], every: float, timeout: float
) -> tuple[list[float], int]:
    """Edit each service's spec (generation + 1), one every `every` s, then collect each lag."""
    custom = client.CustomObjectsApi(api)
    changed: list[tuple[str, int, float]] = []
    for i, name in enumerate(names):
        body = {"spec": {"remediation": {"cooldownSeconds": 301 + i}}}
        got = custom.patch_namespaced_custom_object(
            API_GROUP, API_VERSION, BENCH_NS, PLURAL, name, body, _content_type="application/merge-patch+json"
        )
        changed.append((name, int(got["metadata"]["generation"]), time.monotonic()))
        time.sleep(every)
    deadline = time.monotonic() + timeout
    return collect_lags(
        [
            (at, lambda n=name, g=generation: sw.observed_at(n, g, deadline))
            for name, generation, at in changed
        ]
    )


def collect_lags(changes: list[tuple[float, Any]]) -> tuple[list[float], int]:
    """(lags, missed) of changes made at `at` and seen when their lookup says (None: never)."""
    lags, missed = [], 0
    for at, seen_at in changes:
        seen = seen_at()
        if seen is None:
            missed += 1
        else:
            lags.append(max(0.0, seen - at))
    return lags, missed
