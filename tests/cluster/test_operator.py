"""The operator itself, under kopf's KopfRunner, against the real API server: what it renders
and owns, what `kubectl get` shows, and what it makes of bad agent reports. The harness (the
in-process operator, a test playing the kubelet and the agent) is operator_world.py; the
remediation paths are in test_operator_remediation.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import asdict
from functools import partial
from typing import Any

import pytest
from operator_world import (
    GROUP,
    MERGE,
    MODEL,
    PLURAL,
    SERVICE_LABEL,
    VERSION,
    GiB,
    ReportServer,
    World,
    accepted,
    assert_subset,
    kv_flag,
    managed_by,
    operator,
    owns,
    rejected,
    rejected_twice_since,
    service_doc,
    valid_report,
    vllm_container,
)
from prometheus_client import REGISTRY

from rankguard_agent.wire.recognisers import KVObservation, recognise_all
from rankguard_agent.wire.report import MAX_REPORT_BYTES, KVLine
from rankguard_operator import vllm_snapshots
from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.names import DEFAULT_AGENT_IMAGE, FLAGS_ANNOTATION
from rankguard_operator.core.render.deployment import render_deployment, render_service
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.step import Settings
from rankguard_operator.edge import k8s
from rankguard_operator.edge.executor import Seen, ServiceExecutor
from rankguard_sim.kube.cluster import ControlPlane, free_port
from rankguard_sim.waiting import wait_for

pytestmark = pytest.mark.cluster


# --------------------------------------------------------------------------------------------
# 1. Apply an LLMService: the Deployment and Service exactly as rendered, owned by rankguard


def test_applied_service_renders_the_deployment_and_service_it_owns(
    world: World, cluster: ControlPlane
) -> None:
    port = free_port()
    with operator(world.ns):
        created = world.create(service_doc("svc", port))
        status = world.ready_service("svc")
        wait_for("the Service", lambda: world.core.list_namespaced_service(world.ns).items)
        svc = world.svc("svc")
        spec = parse_spec(svc["spec"])  # as the API server defaulted it
        flags = ServingFlags.from_status(status["servingFlags"])
        assert flags is not None
        # The first budget is the planner's, from the spec's GPU size (no agent has reported yet).
        plan = prior_plan(spec)
        assert plan is not None and flags.kv_cache_memory_bytes == plan.kv_cache_memory_bytes
        uid = created["metadata"]["uid"]
        want = render_deployment(
            "svc", world.ns, uid, spec, flags, agent_image=DEFAULT_AGENT_IMAGE, plan=plan
        )
        live = world.deployment("svc")
        assert live is not None
        assert_subset(want, live)

        # The fields that matter, spelled out (assert_subset would accept extra list items).
        container = vllm_container(live)
        want_container = want["spec"]["template"]["spec"]["containers"][0]
        assert container["command"] == want_container["command"]
        assert container["command"][:3] == ["python3", "/opt/rankguard/agent/rankguard-agent", "launch"]
        assert container["command"][container["command"].index("--") + 1 :][:3] == ["vllm", "serve", MODEL]
        assert kv_flag(live) == plan.kv_cache_memory_bytes
        assert container["resources"] == {
            "requests": {"nvidia.com/gpu": "2", "cpu": "4", "memory": "16Gi"},
            "limits": {"nvidia.com/gpu": "2", "memory": "32Gi"},
        }
        assert container["env"] == want_container["env"]
        assert {"name": "CUDA_DEVICE_ORDER", "value": "PCI_BUS_ID"} in container["env"]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert {"name": "agent", "containerPort": port, "protocol": "TCP"} in container["ports"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"
        assert (
            container["startupProbe"]["failureThreshold"]
            == want_container["startupProbe"]["failureThreshold"]
        )
        assert live["metadata"]["labels"] == want["metadata"]["labels"]
        assert live["metadata"]["ownerReferences"] == [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "LLMService",
                "name": "svc",
                "uid": uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        template_annotations = live["spec"]["template"]["metadata"]["annotations"]
        assert template_annotations == want["spec"]["template"]["metadata"]["annotations"]
        assert json.loads(template_annotations[FLAGS_ANNOTATION]) == flags.to_status()

        service = world.core.read_namespaced_service("svc", world.ns)
        live_service = world.as_dict(service)
        want_service = render_service("svc", world.ns, uid, spec)
        assert_subset(want_service, live_service)
        assert live_service["spec"]["selector"] == {"app.kubernetes.io/name": "vllm", SERVICE_LABEL: "svc"}
        assert [(p["name"], p["port"], p["targetPort"]) for p in live_service["spec"]["ports"]] == [
            ("http", 8000, "http"),
            ("agent", port, "agent"),
        ]

        # Server-side apply: the field manager "rankguard" owns what it rendered.
        for obj in (live, live_service):
            entries = managed_by(obj, k8s.FIELD_MANAGER)
            assert [m["operation"] for m in entries] == ["Apply"], obj["metadata"].get("managedFields")
        fields = managed_by(live, k8s.FIELD_MANAGER)[0]["fieldsV1"]
        vllm_key = 'k:{"name":"vllm"}'
        template_spec = ("f:spec", "f:template", "f:spec", "f:containers", vllm_key)
        assert owns(fields, *template_spec, "f:command")
        assert owns(fields, *template_spec, "f:resources", "f:limits", "f:nvidia.com/gpu")
        assert owns(fields, "f:metadata", "f:ownerReferences")
        assert owns(managed_by(live_service, k8s.FIELD_MANAGER)[0]["fieldsV1"], "f:spec", "f:ports")

        # A person's edits to fields rankguard does not own survive its next apply.
        cluster.kubectl("label", "deployment", "svc", "-n", world.ns, "team=inference")
        cluster.kubectl("annotate", "deployment", "svc", "-n", world.ns, "example.com/oncall=platform")
        generation = world.generation("svc")
        world.custom.patch_namespaced_custom_object(
            GROUP,
            VERSION,
            world.ns,
            PLURAL,
            "svc",
            {"spec": {"engine": {"extraArgs": ["--enable-prefix-caching"]}}},
            _content_type=MERGE,
        )
        live = wait_for(
            "the operator to apply the new spec",
            lambda: (
                (d := world.deployment("svc"))
                and "--enable-prefix-caching" in vllm_container(d)["command"]
                and world.status("svc").get("observedGeneration") == 2
                and d
            ),
        )
        assert live["metadata"]["generation"] == generation + 1
        assert live["metadata"]["labels"]["team"] == "inference"
        assert live["metadata"]["annotations"]["example.com/oncall"] == "platform"
        assert vllm_container(live)["command"][-1] == "--enable-prefix-caching"
        fields = managed_by(live, k8s.FIELD_MANAGER)[0]["fieldsV1"]
        assert not owns(fields, "f:metadata", "f:labels", "f:team")
        assert owns(fields, "f:metadata", "f:labels", f"f:{SERVICE_LABEL}")


# --------------------------------------------------------------------------------------------
# 2. `kubectl get llmservice` shows the columns, from real scraped figures


def metric(name: str, **labels: str) -> float | None:
    """The in-process operator's samples of `name` whose labels include `labels`, summed
    (None when there is none)."""
    found = [
        s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(found) if found else None


def engine_kv_report(min_free: tuple[int, ...], *, tokens: int, concurrency: float) -> bytes:
    """A report whose agent saw the engine print its KV size (vLLM 0.34's one line, rendered from
    the recorded snapshot's template and read by the agent's own recogniser)."""
    doc = json.loads(valid_report(min_free))
    msg = vllm_snapshots.load("0.34.0").messages("kv_cache_size")[0]
    line = str(msg["template"]) % ("GPU", f"{tokens:,}", f"{8192:,}", concurrency)
    seen = [o for o in recognise_all(line) if isinstance(o, KVObservation)]
    assert {o.kind for o in seen} == {"kv_cache_tokens", "max_concurrency"}, line
    doc["kv_lines"] = [asdict(KVLine(o.kind, o.text, o.value, doc["timestamp"])) for o in seen]
    return json.dumps(doc).encode()


def columns(table: str) -> dict[str, str]:
    """The first row of a kubectl table, by header (cells may contain spaces: "rank 1")."""
    header, row = table.splitlines()[:2]
    cells = list(re.finditer(r"\S+", header))
    ends = [c.start() for c in cells[1:]] + [len(row)]
    return {c.group(): row[c.start() : end].strip() for c, end in zip(cells, ends, strict=True)}


def test_kubectl_get_describe_and_metrics_show_the_same_figures(world: World, cluster: ControlPlane) -> None:
    port = free_port()
    with ReportServer(port) as agent, operator(world.ns):
        # Rank 1, not rank 0, has the least headroom: the columns must say so.
        agent.serve(lambda: valid_report((3 * GiB, 2 * GiB)))
        world.create(service_doc("svc", port))
        world.ready_service("svc")
        world.kubelet_ready(world.new_pod("svc")["metadata"]["name"])
        status = wait_for(
            "ranks in status and Ready",
            lambda: (
                (s := world.status("svc")).get("ranks")
                and world.condition("svc", "Ready").get("status") == "True"
                and s
            ),
        )
        assert agent.requests > 0
        got = columns(cluster.kubectl("get", "llmservice", "svc", "-n", world.ns).stdout)
        assert got == {
            "NAME": "svc",
            "MODEL": MODEL,
            "TP": "2",
            "PP": "1",
            "PODS": "",
            "READY": "1/1",
            "KV-BUDGET": status["kvBudget"],
            "RANK0": "3Gi",
            "MIN-HEADROOM": "2Gi",
            "BOTTLENECK": "rank 1",
            "PHASE": "Running",
            "AGE": got["AGE"],
        }
        assert got["KV-BUDGET"].endswith("Gi") and float(got["KV-BUDGET"][:-2]) > 0
        assert [(r["rank"], r["minFreeBytes"]) for r in status["ranks"]] == [(0, 3 * GiB), (1, 2 * GiB)]

        # `kubectl describe`: one line per rank, times as RFC 3339 (not 1.8e+09)
        described = cluster.kubectl("describe", "llmservice", "svc", "-n", world.ns).stdout
        per_rank = described.split("Per Rank:", 1)[1].splitlines()[1:3]
        assert [line.split(":", 1)[0].strip() for line in per_rank] == ["rank 0", "rank 1"], described
        assert "rank 1: headroom 2Gi, free " in per_rank[1] and " of 80Gi (GPU " in per_rank[1]
        assert not re.search(r"\de\+0\d", described), described  # no float in scientific notation

        # the metrics say what the status says, labelled by namespace and service
        labels = {"namespace": world.ns, "llmservice": "svc"}
        assert (
            metric("rankguard_llmservice_kv_budget_bytes", **labels) == status["budget"]["kvCacheMemoryBytes"]
        )
        assert metric("rankguard_llmservice_rank_headroom_bytes", rank="1", **labels) == 2 * GiB
        assert metric("rankguard_llmservice_min_headroom_bytes", **labels) == 2 * GiB
        assert metric("rankguard_llmservice_phase", phase="Running", **labels) == 1
        assert metric("rankguard_llmservice_condition", condition="Ready", status="True", **labels) == 1
        assert metric("rankguard_operator_last_pass_timestamp_seconds", **labels) > 0

        # status.capacity and its gauges: the plan's figure while no engine has said its own
        # (these reports carry no KV lines), labelled with vLLM's model_name
        capacity = status["capacity"]
        assert capacity == {
            "tokens": status["budget"]["tokens"],
            "maxConcurrency": status["budget"]["maxConcurrency"],
            "source": "planned",
            "modelName": MODEL,
        }
        kv = {**labels, "model_name": MODEL}
        assert metric("rankguard_llmservice_kv_capacity_tokens", **kv) == capacity["tokens"]
        assert metric("rankguard_llmservice_kv_max_concurrency", **kv) == capacity["maxConcurrency"]
        # then the engine's own "KV cache size" line, once its agent reports it
        agent.serve(lambda: engine_kv_report((3 * GiB, 2 * GiB), tokens=123_456, concurrency=15.07))
        engine = wait_for(
            "the engine's capacity in status",
            lambda: (c := world.status("svc").get("capacity") or {}).get("source") == "engine" and c,
        )
        assert engine == {"tokens": 123_456, "maxConcurrency": 15.07, "source": "engine", "modelName": MODEL}
        wait_for(
            "the engine's capacity in the metrics",
            lambda: (
                metric("rankguard_llmservice_kv_capacity_tokens", **kv) == 123_456
                and metric("rankguard_llmservice_kv_max_concurrency", **kv) == 15.07
            ),
        )
        # at 0 replicas no agent answers, and the capacity a scaler needs to scale up stays
        world.custom.patch_namespaced_custom_object(
            GROUP, VERSION, world.ns, PLURAL, "svc", {"spec": {"replicas": 0}}, _content_type=MERGE
        )
        wait_for(
            "the Deployment at 0 replicas and its pod going",
            lambda: (
                ((world.deployment("svc") or {}).get("spec") or {}).get("replicas") == 0
                and all(p["metadata"].get("deletionTimestamp") for p in world.pods("svc"))
            ),
        )
        agent.serve(b"{}", status=503)
        world.let_the_loop_look("svc")
        assert world.status("svc")["capacity"] == engine
        assert metric("rankguard_llmservice_kv_capacity_tokens", **kv) == 123_456


# --------------------------------------------------------------------------------------------
# 3. Bad reports are counted, ignored, and survived


def _report_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(valid_report((3 * GiB, 2 * GiB)))
    doc.update(changes)
    return doc


def _rank_doc(**changes: Any) -> dict[str, Any]:
    rank: dict[str, Any] = json.loads(valid_report((3 * GiB,)))["ranks"][0]
    rank.update(changes)
    return rank


def dumps(doc: Any) -> bytes:
    return json.dumps(doc).encode()


def hostile_reports() -> list[tuple[str, bytes, int, str]]:
    """(what, body, HTTP status, the reason it must be counted under)."""
    head = b'{"version":1,"agent_version":"x","timestamp":'
    nested = head + b'1,"ranks":' + b"[" * 60_000 + b"]" * 60_000 + b"}"
    negative = _rank_doc(free_bytes=-1, min_free_bytes=-1)
    huge_digits = head + b"9" * 5000 + b',"ranks":[]}'
    return [
        ("truncated JSON", b'{"version": 1, "ranks": [{"rank": 0, ', 200, "malformed"),
        ("an HTML error page", b"<html><body>502 Bad Gateway</body></html>", 200, "malformed"),
        ("an HTTP error", b"{}", 500, "http-status"),
        ("oversized", dumps(_report_doc(agent_version="x" * (MAX_REPORT_BYTES + 1))), 200, "oversized"),
        ("deeply nested JSON", nested, 200, "malformed"),
        ("ranks of the wrong type", dumps(_report_doc(ranks={"0": "lots"})), 200, "malformed"),
        ("a string where a number goes", dumps(_report_doc(timestamp="now")), 200, "malformed"),
        ("negative free memory", dumps(_report_doc(ranks=[negative])), 200, "malformed"),
        ("a petabyte GPU", dumps(_report_doc(ranks=[_rank_doc(total_bytes=10**30)])), 200, "malformed"),
        # Python refuses integers of more than 4300 digits with a ValueError, not a JSON error.
        ("a 5000-digit integer", huge_digits, 200, "malformed"),
    ]


def test_malformed_oversized_and_hostile_reports_are_counted_and_ignored(world: World) -> None:
    port = free_port()
    ns = world.ns
    with ReportServer(port) as agent, operator(ns):
        agent.serve(b"", status=503)
        world.create(service_doc("svc", port))
        world.ready_service("svc")
        world.kubelet_ready(world.new_pod("svc")["metadata"]["name"])
        wait_for("Ready True", lambda: world.condition("svc", "Ready").get("status") == "True")
        generation = world.generation("svc")

        for what, body, http_status, reason in hostile_reports():
            agent.serve(body, status=http_status)
            start = rejected(ns, "svc", reason)
            wait_for(
                f"{what} to be rejected as {reason}", partial(rejected_twice_since, ns, "svc", reason, start)
            )
            status = world.status("svc")
            assert not status.get("ranks"), (what, status.get("ranks"))
            assert "rank0Headroom" not in status and "bottleneck" not in status, what
            assert not status.get("remediations"), what
            assert world.generation("svc") == generation, what
        assert accepted(ns, "svc") == 0

        # The operator kept running: a good report (one over aiohttp's first read, too) is taken.
        padding = b" " * (200 * 1024)  # JSON allows whitespace; 200 KiB is under the limit
        agent.serve(lambda: valid_report((3 * GiB, 2 * GiB)) + padding)
        status = wait_for("the good report in status", lambda: (s := world.status("svc")).get("ranks") and s)
        assert accepted(ns, "svc") >= 1
        assert status["bottleneck"] == "rank 1" and status["minHeadroom"] == "2Gi"
        assert world.generation("svc") == generation
        assert not world.warning_events("svc")


def test_a_pass_for_a_service_that_is_gone_ends_its_loop(world: World) -> None:
    """A daemon that outlives its LLMService (deleted at once, without kopf's finalizer under
    way: kopf stops daemons only for a deletion it sees in progress) must stop, not keep
    re-creating a Deployment the garbage collector removes again. Its status write answers 404:
    the pass raises ServiceGone, which ends the loop (edge/handlers)."""
    body = world.create(service_doc("vanished", free_port()))  # no operator runs: no finalizer
    world.custom.delete_namespaced_custom_object(GROUP, VERSION, world.ns, PLURAL, "vanished")
    wait_for(
        "the LLMService to be gone",
        lambda: not world.custom.list_namespaced_custom_object(GROUP, VERSION, world.ns, PLURAL).get("items"),
    )
    k8s.login()
    executor = ServiceExecutor("vanished", world.ns, Settings(agent_image=DEFAULT_AGENT_IMAGE))

    async def one_pass() -> None:
        try:
            await executor.run_once(Seen(body=body, pods=[], deployment=None, replicaset_owner={}))
        finally:
            executor.forget()  # as the daemon does: no series of it left in this process's registry
            await executor.close()

    with pytest.raises(k8s.ServiceGone, match="vanished"):
        asyncio.run(one_pass())
