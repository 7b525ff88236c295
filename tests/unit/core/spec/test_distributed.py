"""spec.distributed as the parser reads it, `rankguard plan --pods` and `rankguard render --check`
for a multi-node service: what cannot work is refused with its own message; a group's pods get
their share of the GPUs and one set of model and parallel flags."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from rankguard_operator.cli import main
from rankguard_operator.cli_render import check_groups, render_service
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.render.group import GroupInputs, render_group_set
from rankguard_operator.core.render.leader_worker_set import WORKER_INDEX_LABEL
from rankguard_operator.core.render.lws_rules import lws_problems
from rankguard_operator.core.render.pod import served_argv
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_operator.core.units import GiB
from tests.builders import llmservice

BASE: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-70B-Instruct"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 8,
    "pipelineParallelSize": 2,
    "distributed": {"podsPerGroup": 2},
}


def spec(**changes: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    for k, v in changes.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    return doc


def test_a_group_holds_its_gpus_in_equal_whole_shares() -> None:
    s = parse_spec(spec())
    assert s.distributed is not None and s.distributed.pods_per_group == 2
    assert (s.world_size, s.pods_per_replica, s.gpus_per_pod) == (16, 2, 8)
    assert s.distributed.workload == "StatefulSet" and s.distributed.rendezvous_port == 29501
    single = parse_spec(spec(distributed=None))
    assert single.distributed is None and single.gpus_per_pod == 16


@pytest.mark.parametrize(
    ("distributed", "extra", "message"),
    [
        ({"podsPerGroup": 3}, [], "does not divide over spec.distributed.podsPerGroup (3)"),
        ({"podsPerGroup": 32}, [], "spec.distributed.podsPerGroup (32) is more pods than the replica's GPUs"),
        ({"podsPerGroup": 1}, [], "spec.distributed.podsPerGroup must be between 2 and 64, got 1"),
        ({}, [], "spec.distributed.podsPerGroup is required"),
        (
            {"podsPerGroup": 2, "rendezvousPort": 8000},
            [],
            "rendezvousPort 8000 is already the pod's vLLM HTTP port",
        ),
        (
            {"podsPerGroup": 2, "rendezvousPort": 9404},
            [],
            "rendezvousPort 9404 is already the pod's agent port",
        ),
        ({"podsPerGroup": 2, "workload": "Ray"}, [], "spec.distributed.workload must be one of"),
        ({"podsPerGroup": 2, "networkInterface": "eth 0"}, [], "is not an interface list NCCL and Gloo read"),
        ({"podsPerGroup": 2, "timeoutSeconds": 1}, [], "spec.distributed.timeoutSeconds must be between"),
        ({"podsPerGroup": 2, "nodes": 2}, [], "spec.distributed has no field 'nodes'"),
        (
            {"podsPerGroup": 2, "workerTemplate": {"spec": {"affinity": {}}}},
            [],
            "spec.distributed.workerTemplate.spec.affinity cannot be set",
        ),
        (
            {"podsPerGroup": 2, "workerTemplate": {"metadata": {"labels": {"rankguard.io/x": "y"}}}},
            [],
            "spec.distributed.workerTemplate.metadata.labels cannot set 'rankguard.io/x'",
        ),
        ({"podsPerGroup": 2}, ["--nnodes", "2"], "--nnodes is set by rankguard on every pod of a group"),
        ({"podsPerGroup": 2}, ["-r", "1"], "-r (vLLM reads it as --node-rank) is set by rankguard"),
        ({"podsPerGroup": 2}, ["--master-addr=10.0.0.1"], "use spec.distributed (the leader pod's name"),
        ({"podsPerGroup": 2}, ["--master-port", "1234"], "use spec.distributed.rendezvousPort instead"),
        ({"podsPerGroup": 2}, ["--headless"], "every pod but the leader runs headless"),
        (
            {"podsPerGroup": 2},
            ["--distributed-timeout-seconds", "60"],
            "use spec.distributed.timeoutSeconds instead",
        ),
        (
            {"podsPerGroup": 2},
            ["--distributed-executor-backend", "ray"],
            "which pod holds which rank (and which rank ran out of memory) cannot be computed",
        ),
        ({"podsPerGroup": 2}, ["--data-parallel-size", "2"], "use spec.replicas instead"),
    ],
)
def test_what_cannot_work_is_refused_with_its_own_message(
    distributed: dict[str, Any], extra: list[str], message: str
) -> None:
    with pytest.raises(SpecError) as e:
        parse_spec(spec(distributed=distributed, engine={"extraArgs": extra}))
    assert message in str(e.value)


def test_a_single_pod_service_still_refuses_multi_node_flags_and_points_at_the_block() -> None:
    with pytest.raises(SpecError, match=r"set spec\.distributed\.podsPerGroup"):
        parse_spec(spec(distributed=None, engine={"extraArgs": ["--nnodes", "2"]}))


def test_the_template_cannot_set_what_a_group_sets() -> None:
    vllm = {"name": "vllm", "env": [{"name": "VLLM_HOST_IP", "value": "1.2.3.4"}]}
    with pytest.raises(SpecError, match="cannot set VLLM_HOST_IP"):
        parse_spec(spec(template={"spec": {"containers": [vllm]}}))
    iface = {"name": "vllm", "env": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth1"}]}
    parse_spec(spec(template={"spec": {"containers": [iface]}}))  # without networkInterface it is theirs
    with pytest.raises(SpecError, match="networkInterface sets it"):
        parse_spec(
            spec(
                template={"spec": {"containers": [iface]}},
                distributed={"podsPerGroup": 2, "networkInterface": "eth0"},
            )
        )


def _group_set(doc: dict[str, Any]) -> dict[str, Any]:
    return render_group_set(
        "llama",
        "ns",
        "uid",
        GroupInputs(parse_spec(doc), ServingFlags(kv_cache_memory_bytes=20 * GiB), "a:1", None),
    )


def test_worker_overrides_and_the_network_interface_reach_the_right_pods() -> None:
    doc = spec(
        distributed={
            "podsPerGroup": 2,
            "networkInterface": "eth1",
            "timeoutSeconds": 120,
            "workerTemplate": {
                "metadata": {"labels": {"tier": "w"}},
                "spec": {"nodeSelector": {"pool": "b"}},
            },
        },
        template={"spec": {"nodeSelector": {"pool": "a", "zone": "z1"}}},
    )
    [g] = _group_set(doc)["groups"]
    lt, wt = g.leader["spec"]["template"], g.workers["spec"]["template"]
    assert lt["spec"]["nodeSelector"] == {"pool": "a", "zone": "z1"}
    assert wt["spec"]["nodeSelector"] == {"pool": "b", "zone": "z1"}
    assert wt["metadata"]["labels"]["tier"] == "w" and "tier" not in lt["metadata"]["labels"]
    for t in (lt, wt):
        env = {e["name"]: e.get("value") for e in t["spec"]["containers"][0]["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth1"
        argv = served_argv(t["spec"])
        assert argv[argv.index("--distributed-timeout-seconds") + 1] == "120"


def test_one_template_hash_for_every_group_and_a_new_one_for_a_new_budget() -> None:
    a = _group_set(spec(replicas=3))
    hashes = {
        s["spec"]["template"]["metadata"]["annotations"]["rankguard.io/template-hash"]
        for g in a["groups"]
        for s in (g.leader, g.workers)
    }
    assert len(hashes) == 1
    b = render_group_set(
        "llama",
        "ns",
        "uid",
        GroupInputs(parse_spec(spec(replicas=3)), ServingFlags(kv_cache_memory_bytes=19 * GiB), "a:1", None),
    )
    assert b["spec"]["template"] != a["spec"]["template"]


def test_the_leader_worker_set_passes_lws_webhook_rules_and_reads_the_worker_index() -> None:
    doc = _group_set(spec(replicas=2, distributed={"podsPerGroup": 2, "workload": "LeaderWorkerSet"}))
    lws = doc["leaderWorkerSet"]
    assert lws_problems(lws) == []
    assert lws["spec"]["replicas"] == 2 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    env = {e["name"]: e for e in worker["spec"]["containers"][0]["env"]}
    assert (
        env["RANKGUARD_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
        == f"metadata.labels['{WORKER_INDEX_LABEL}']"
    )
    argv = served_argv(worker["spec"])
    assert argv[argv.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)" and "--headless" in argv


PLAN = [
    "plan",
    "--model",
    "meta-llama/Llama-3.1-70B-Instruct",
    "--tp",
    "8",
    "--pp",
    "2",
    "--gpu-memory",
    "80GiB",
]


def _plan(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, Any]:
    assert main([*PLAN, "--json", *extra]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_plan_says_which_pod_holds_which_rank_and_gives_each_pods_command_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = _plan(capsys, "--pods", "2")
    assert {r["rank"]: r["pod"] for r in doc["ranks"]} == {r: r // 8 for r in range(16)}
    # the last stage (lm_head, logits, sampler) is on pod 1: the bottleneck lives there
    assert doc["bottleneck_rank"] >= 8 and doc["bottleneck_pod"] == 1
    lead, work = doc["flags"], doc["worker_flags"]
    assert lead[lead.index("--node-rank") + 1] == "0" and "--headless" in work
    assert doc["kv_cache_memory_bytes"] == _plan(capsys)["kv_cache_memory_bytes"]  # the same budget
    assert main([*PLAN]) == 0 and "POD" not in capsys.readouterr().out
    assert main([*PLAN, "--pods", "2"]) == 0
    text = capsys.readouterr().out
    assert "over 2 pods of 8 GPUs" in text and "on pod 1 minus" in text
    assert main([*PLAN, "--pods", "3"]) == 2  # 16 GPUs do not divide over 3 pods
    assert "does not divide over spec.distributed.podsPerGroup (3)" in capsys.readouterr().err


def test_render_check_finds_a_group_whose_pods_disagree() -> None:
    service = llmservice("llama", spec(memory={"gpuMemoryBytes": 80 * GiB}))
    objects, refused = render_service(service, namespace="ns", agent_image="a:1", gpu_memory_bytes=None)
    assert refused == [] and check_groups(objects) == []
    sets = [o for o in objects if o["kind"] == "StatefulSet"]
    assert len(sets) == 2
    workers = copy.deepcopy(sets[1])
    cmd = workers["spec"]["template"]["spec"]["containers"][0]["command"]
    cmd[cmd.index("--max-num-seqs") + 1] = "64"
    problems = check_groups([sets[0], workers])
    assert len(problems) == 1 and "--max-num-seqs" not in problems[0] and "64" in problems[0]
    assert yaml.safe_dump(objects)  # printable
