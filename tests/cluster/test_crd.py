"""The LLMService CRD on a real kube-apiserver: what `kubectl apply` accepts, what it refuses and
with which message, the TP-change transition rule, the status subresource, and the columns
`kubectl get llmservice` prints.

(Over 450 lines because most of it is the table of valid and refused objects, one per CRD
rule, held against one API server started once for the module.)
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankguard_operator.core.observe.memory_trend import MemoryTrend
from rankguard_sim.kube.cluster import ControlPlane
from tests.builders import llmservice

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "examples" / "llama3-70b-tp4.yaml").read_text())

SHAPE = {
    "vocabSize": 32000,
    "hiddenSize": 4096,
    "numLayers": 32,
    "numHeads": 32,
    "numKVHeads": 8,
    "intermediateSize": 11008,
}


def minimal(name: str = "svc") -> dict[str, Any]:
    return llmservice(
        name, {"model": {"name": "meta-llama/Meta-Llama-3-8B"}, "image": "vllm/vllm-openai:v0.33.0"}
    )


def with_spec(**changes: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that merges `changes` into .spec (nested dicts merge, None deletes)."""

    def merge(into: dict[str, Any], changes: dict[str, Any]) -> None:
        for k, v in changes.items():
            if v is None:
                into.pop(k, None)
            elif isinstance(v, dict) and isinstance(into.get(k), dict):
                merge(into[k], v)
            else:
                into[k] = v

    return lambda obj: merge(obj["spec"], copy.deepcopy(changes))


def apply(cluster: ControlPlane, namespace: str, obj: dict[str, Any]) -> Any:
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False)


def get(cluster: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    r = cluster.kubectl("get", "llmservice", name, "-n", namespace, "-o", "json")
    doc: dict[str, Any] = json.loads(r.stdout)
    return doc


VALID: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("minimal", with_spec()),
    ("example", lambda obj: obj.update(spec=copy.deepcopy(EXAMPLE["spec"]))),
    (
        "shape-override",
        with_spec(model={"name": "acme/private-7b", "shape": {**SHAPE, "tieWordEmbeddings": True}}),
    ),
    (
        "moe-shape",
        with_spec(model={"name": "acme/moe", "shape": {**SHAPE, "numExperts": 8, "expertsPerToken": 2}}),
    ),
    ("config-map", with_spec(model={"name": "acme/private-7b", "configMap": {"name": "private-7b-config"}})),
    ("pinned-budget", with_spec(memory={"kvCacheMemoryBytes": 40 * 2**30})),
    ("utilisation", with_spec(memory={"gpuMemoryUtilization": 0.9})),
    ("utilisation-max", with_spec(memory={"gpuMemoryUtilization": 0.99})),
    ("tp64", with_spec(tensorParallelSize=64)),
    ("tp16-replicated-kv-heads", with_spec(tensorParallelSize=16, model={"name": "x", "shape": SHAPE})),
    ("scaled-to-zero", with_spec(replicas=0)),
    ("no-cooldown", with_spec(remediation={"cooldownSeconds": 0})),
    ("floor-equals-ceiling", with_spec(remediation={"minKVCacheBytes": 2**30, "maxKVCacheBytes": 2**30})),
    ("pinned-at-the-minimum", with_spec(memory={"kvCacheMemoryBytes": 2**20})),
    (
        "floor-below-gpu",
        with_spec(memory={"gpuMemoryBytes": 80 * 2**30}, remediation={"minKVCacheBytes": 79 * 2**30}),
    ),
    (
        "pinned-inside-bounds",
        with_spec(
            memory={"kvCacheMemoryBytes": 2 * 2**30},
            remediation={"minKVCacheBytes": 2**30, "maxKVCacheBytes": 4 * 2**30},
        ),
    ),
    (
        "other-extra-args",
        with_spec(engine={"extraArgs": ["--enable-prefix-caching", "--served-model-name=x"]}),
    ),
    (
        "host-memory-quantity",
        with_spec(remediation={"maxHostMemory": "512Gi"}, resources={"limits": {"memory": "64Gi"}}),
    ),
    (
        "multi-node",
        with_spec(
            tensorParallelSize=8,
            pipelineParallelSize=2,
            distributed={
                "podsPerGroup": 2,
                "timeoutSeconds": 300,
                "networkInterface": "eth0",
                "workerTemplate": {
                    "metadata": {"labels": {"team": "llm"}},
                    "spec": {
                        "nodeSelector": {"pool": "h100"},
                        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    },
                },
            },
        ),
    ),
    (
        "multi-node-lws",
        with_spec(tensorParallelSize=4, distributed={"podsPerGroup": 4, "workload": "LeaderWorkerSet"}),
    ),
]


@pytest.mark.parametrize(("name", "mutate"), VALID, ids=[v[0] for v in VALID])
def test_valid_objects_are_accepted(
    cluster: ControlPlane, crd: str, namespace: str, name: str, mutate: Callable[[dict[str, Any]], None]
) -> None:
    obj = minimal(name)
    mutate(obj)
    r = apply(cluster, namespace, obj)
    assert r.returncode == 0, r.stderr
    stored = get(cluster, namespace, name)
    # defaults land, so the operator never has to guess
    spec = stored["spec"]
    # no blockSize default: unset, vLLM picks it per attention backend
    assert spec["engine"].get("blockSize") == obj["spec"].get("engine", {}).get("blockSize")
    assert spec["memory"]["safetyMarginBytes"] == obj["spec"].get("memory", {}).get(
        "safetyMarginBytes", 512 * 2**20
    )
    assert spec["remediation"]["enabled"] is True
    assert spec["tensorParallelSize"] == obj["spec"].get("tensorParallelSize", 1)


INVALID: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "tp-zero",
        with_spec(tensorParallelSize=0),
        "spec.tensorParallelSize: Invalid value: 0: "
        "spec.tensorParallelSize in body should be greater than or equal to 1",
    ),
    (
        "tp-65",
        with_spec(tensorParallelSize=65),
        "spec.tensorParallelSize in body should be less than or equal to 64",
    ),
    (
        "gpus-per-replica",
        with_spec(tensorParallelSize=16, pipelineParallelSize=8),
        "(GPUs per replica) must be at most 64",
    ),
    (
        "replicas-negative",
        with_spec(replicas=-1),
        "spec.replicas in body should be greater than or equal to 0",
    ),
    (
        "util-zero",
        with_spec(memory={"gpuMemoryUtilization": 0}),
        'spec.memory.gpuMemoryUtilization: Invalid value: "number": '
        "memory.gpuMemoryUtilization must be greater than 0 and at most 0.99",
    ),
    (
        "util-one",
        with_spec(memory={"gpuMemoryUtilization": 1}),
        "at most 0.99: it is the fraction of each GPU",
    ),
    (
        "util-too-high",
        with_spec(memory={"gpuMemoryUtilization": 0.995}),
        "and the CUDA context and NCCL buffers",
    ),
    (
        "pinned-and-util",
        with_spec(memory={"gpuMemoryUtilization": 0.9, "kvCacheMemoryBytes": 2**30}),
        "set memory.kvCacheMemoryBytes (a pinned per-GPU KV budget) or memory.gpuMemoryUtilization",
    ),
    (
        "floor-above-ceiling",
        with_spec(remediation={"minKVCacheBytes": 2 * 2**30, "maxKVCacheBytes": 2**30}),
        "remediation.minKVCacheBytes (the floor) must be <= remediation.maxKVCacheBytes",
    ),
    (
        "pinned-below-floor",
        with_spec(memory={"kvCacheMemoryBytes": 2**30}, remediation={"minKVCacheBytes": 2 * 2**30}),
        "memory.kvCacheMemoryBytes is below remediation.minKVCacheBytes",
    ),
    (
        "pinned-above-ceiling",
        with_spec(memory={"kvCacheMemoryBytes": 8 * 2**30}, remediation={"maxKVCacheBytes": 4 * 2**30}),
        "memory.kvCacheMemoryBytes is above remediation.maxKVCacheBytes",
    ),
    (
        "pinned-one-byte",
        with_spec(memory={"kvCacheMemoryBytes": 1}),
        "memory.kvCacheMemoryBytes must be at least 1048576 (1 MiB): it is in bytes, per GPU",
    ),
    (
        "floor-above-gpu",
        with_spec(memory={"gpuMemoryBytes": 80 * 2**30}, remediation={"minKVCacheBytes": 15 * 2**39}),
        "remediation.minKVCacheBytes (the floor of the per-GPU KV budget) must be smaller than "
        "memory.gpuMemoryBytes",
    ),
    (
        "pinned-above-gpu",
        with_spec(memory={"kvCacheMemoryBytes": 80 * 2**30, "gpuMemoryBytes": 80 * 2**30}),
        "memory.kvCacheMemoryBytes must be smaller than memory.gpuMemoryBytes",
    ),
    (
        "headroom-above-margin",
        with_spec(memory={"minHeadroomBytes": 2**30, "safetyMarginBytes": 2**29}),
        "memory.minHeadroomBytes must not exceed memory.safetyMarginBytes",
    ),
    (
        "cooldown-negative",
        with_spec(remediation={"cooldownSeconds": -1}),
        "spec.remediation.cooldownSeconds in body should be greater than or equal to 0",
    ),
    (
        "bump-ratio-below-one",
        with_spec(remediation={"hostMemoryBumpRatio": 0.5}),
        "spec.remediation.hostMemoryBumpRatio in body should be greater than or equal to 1",
    ),
    ("no-model", with_spec(model=None), "spec.model: Required value"),
    ("no-image", with_spec(image=None), "spec.image: Required value"),
    (
        "shape-incomplete",
        with_spec(model={"name": "x", "shape": {**SHAPE, "numKVHeads": None}}),
        "spec.model.shape.numKVHeads: Required value",
    ),
    (
        "shape-zero-layers",
        with_spec(model={"name": "x", "shape": {**SHAPE, "numLayers": 0}}),
        "spec.model.shape.numLayers in body should be greater than or equal to 1",
    ),
    (
        "shape-heads-not-multiple",
        with_spec(model={"name": "x", "shape": {**SHAPE, "numKVHeads": 6}}),
        "model.shape.numHeads must be a multiple of model.shape.numKVHeads",
    ),
    (
        "shape-uneven-head-dim",
        with_spec(model={"name": "x", "shape": {**SHAPE, "hiddenSize": 4100}}),
        "give model.shape.headDim explicitly",
    ),
    (
        "shape-half-moe",
        with_spec(model={"name": "x", "shape": {**SHAPE, "numExperts": 8}}),
        "model.shape.numExperts and model.shape.expertsPerToken go together",
    ),
    (
        "shape-and-configmap",
        with_spec(model={"name": "x", "shape": SHAPE, "configMap": {"name": "c"}}),
        "give model.shape or model.configMap, not both",
    ),
    (
        "tp-does-not-divide-heads",
        with_spec(tensorParallelSize=3, model={"name": "x", "shape": SHAPE}),
        "tensorParallelSize must divide model.shape.numHeads",
    ),
    (
        "tp-and-kv-heads",
        with_spec(
            tensorParallelSize=4,
            model={"name": "x", "shape": {**SHAPE, "numHeads": 24, "numKVHeads": 6, "hiddenSize": 3072}},
        ),
        "tensorParallelSize and model.shape.numKVHeads must divide one another",
    ),
    (
        "managed-flag-in-extra-args",
        with_spec(engine={"extraArgs": ["--gpu-memory-utilization=0.8"]}),
        "engine.extraArgs must not set options rankguard manages",
    ),
    (
        "batched-below-seqs",
        with_spec(engine={"maxNumSeqs": 512, "maxNumBatchedTokens": 256}),
        "engine.maxNumBatchedTokens must be >= engine.maxNumSeqs",
    ),
    (
        "kv-dtype",
        with_spec(engine={"kvCacheDtype": "fp4"}),
        'spec.engine.kvCacheDtype: Unsupported value: "fp4"',
    ),
    (
        "logits-mode",
        with_spec(engine={"logitsMode": "scatter"}),
        'spec.engine.logitsMode: Unsupported value: "scatter"',
    ),
    ("block-size", with_spec(engine={"blockSize": 7}), "spec.engine.blockSize: Unsupported value: 7"),
    (
        "bytes-as-string",
        with_spec(memory={"kvCacheMemoryBytes": "40Gi"}),
        'spec.memory.kvCacheMemoryBytes: Invalid value: "string": '
        "spec.memory.kvCacheMemoryBytes in body must be of type integer",
    ),
    (
        "bad-quantity",
        with_spec(remediation={"maxHostMemory": "lots"}),
        "spec.remediation.maxHostMemory in body should match",
    ),
    (
        "group-not-divisible",
        with_spec(tensorParallelSize=8, pipelineParallelSize=2, distributed={"podsPerGroup": 3}),
        "does not divide over distributed.podsPerGroup",
    ),
    (
        "group-more-pods-than-gpus",
        with_spec(tensorParallelSize=2, distributed={"podsPerGroup": 4}),
        "distributed.podsPerGroup is more pods than the replica's GPUs",
    ),
    (
        "group-one-pod",
        with_spec(tensorParallelSize=2, distributed={"podsPerGroup": 1}),
        "spec.distributed.podsPerGroup: Invalid value: 1: spec.distributed.podsPerGroup in body should be "
        "greater than or equal to 2",
    ),
    (
        "group-port-clash",
        with_spec(tensorParallelSize=2, distributed={"podsPerGroup": 2, "rendezvousPort": 8000}),
        "distributed.rendezvousPort is already one of the pod's ports",
    ),
    (
        "group-workload",
        with_spec(tensorParallelSize=2, distributed={"podsPerGroup": 2, "workload": "Ray"}),
        'spec.distributed.workload: Unsupported value: "Ray"',
    ),
    (
        "group-interface",
        with_spec(tensorParallelSize=2, distributed={"podsPerGroup": 2, "networkInterface": "eth 0"}),
        "spec.distributed.networkInterface in body should match",
    ),
]


def test_every_invalid_case_has_its_own_message() -> None:
    messages = [m for _, _, m in INVALID]
    assert len(set(messages)) == len(messages)


@pytest.mark.parametrize("case", INVALID, ids=[v[0] for v in INVALID])
def test_invalid_objects_are_refused_with_their_message(
    cluster: ControlPlane, crd: str, namespace: str, case: tuple[str, Callable[[dict[str, Any]], None], str]
) -> None:
    name, mutate, message = case
    obj = minimal(name)
    mutate(obj)
    r = apply(cluster, namespace, obj)
    assert r.returncode != 0, f"{name} was accepted"
    assert message in r.stderr, r.stderr
    # refused outright: nothing was stored
    assert cluster.kubectl("get", "llmservice", name, "-n", namespace, check=False).returncode != 0


def patch(cluster: ControlPlane, namespace: str, name: str, body: dict[str, Any], *extra: str) -> Any:
    return cluster.kubectl(
        "patch",
        "llmservice",
        name,
        "-n",
        namespace,
        "--type=merge",
        "-p",
        json.dumps(body),
        *extra,
        check=False,
    )


def test_tp_change_with_a_pinned_budget_is_refused_until_unpinned(
    cluster: ControlPlane, crd: str, namespace: str
) -> None:
    obj = minimal("pinned")
    with_spec(tensorParallelSize=4, memory={"kvCacheMemoryBytes": 40 * 2**30})(obj)
    assert apply(cluster, namespace, obj).returncode == 0

    r = patch(cluster, namespace, "pinned", {"spec": {"tensorParallelSize": 8}})
    assert r.returncode != 0
    assert "cannot change while memory.kvCacheMemoryBytes is pinned" in r.stderr
    assert "Remove memory.kvCacheMemoryBytes in the same change" in r.stderr
    r = patch(cluster, namespace, "pinned", {"spec": {"pipelineParallelSize": 2}})
    assert "cannot change while memory.kvCacheMemoryBytes is pinned" in r.stderr
    assert get(cluster, namespace, "pinned")["spec"]["tensorParallelSize"] == 4

    # other edits of a pinned object are fine
    assert patch(cluster, namespace, "pinned", {"spec": {"replicas": 2}}).returncode == 0
    # unpinning in the same change lets rankguard re-plan for the new TP
    r = patch(
        cluster,
        namespace,
        "pinned",
        {"spec": {"tensorParallelSize": 8, "memory": {"kvCacheMemoryBytes": None}}},
    )
    assert r.returncode == 0, r.stderr
    spec = get(cluster, namespace, "pinned")["spec"]
    assert spec["tensorParallelSize"] == 8
    assert "kvCacheMemoryBytes" not in spec["memory"]
    # and an unpinned object changes TP freely
    assert patch(cluster, namespace, "pinned", {"spec": {"tensorParallelSize": 2}}).returncode == 0


STATUS: dict[str, Any] = {
    "phase": "Running",
    "observedGeneration": 1,
    "conditions": [
        {
            "type": "Ready",
            "status": "True",
            "reason": "AllRanksReporting",
            "message": "4/4 ranks reporting",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "observedGeneration": 1,
        }
    ],
    "ranks": [
        {
            "rank": r,
            "uuid": f"GPU-{r}",
            "totalBytes": 80 * 2**30,
            "freeBytes": (2 + r) * 2**30,
            "minFreeBytes": (1 + r) * 2**30,
            "headroomBytes": (1 + r) * 2**30,
            "headroom": f"{1 + r}Gi",
            "stale": False,
        }
        for r in range(4)
    ],
    "bottleneckRank": 0,
    "readyReplicas": 1,
    "ready": "1/1",
    "kvBudget": "54.6Gi",
    "rank0Headroom": "1.4Gi",
    "minHeadroom": "812Mi",
    "bottleneck": "rank 2",
    "budget": {
        "kvCacheMemoryBytes": 58648166400,
        "gpuMemoryUtilization": 0.9132,
        "blocks": 89490,
        "tokens": 1431840,
        "maxConcurrency": 174.79,
        "source": "measured",
    },
    "lastKnownGood": {
        "flags": ["--kv-cache-memory-bytes", "58648166400"],
        "kvCacheMemoryBytes": 58648166400,
        "memoryLimit": "128Gi",
        "revision": "3",
    },
    "remediations": [
        {
            "time": "2026-01-01T00:00:00Z",
            "trigger": "CUDAOutOfMemory",
            "action": "ShrinkKVCache",
            "rank": 0,
            "from": 59000000000,
            "to": 58648166400,
            "revision": 3,
            "message": "rank 0 ran out of memory",
        }
    ],
    "pendingRemediation": {
        "id": "r-1",
        "kind": "ShrinkKVCache",
        "targetRevision": 4,
        "startedAt": "2026-01-01T00:01:00Z",
    },
}


def test_status_subresource_and_printer_columns(cluster: ControlPlane, crd: str, namespace: str) -> None:
    obj = minimal("shown")
    with_spec(tensorParallelSize=4, model={"name": "meta-llama/Meta-Llama-3-70B"})(obj)
    assert apply(cluster, namespace, obj).returncode == 0

    # status is a subresource: a plain update cannot write it
    patch(cluster, namespace, "shown", {"status": {"phase": "Hacked"}})
    assert (
        "status" not in get(cluster, namespace, "shown")
        or get(cluster, namespace, "shown")["status"].get("phase") != "Hacked"
    )
    r = patch(cluster, namespace, "shown", {"status": STATUS}, "--subresource=status")
    assert r.returncode == 0, r.stderr
    stored = get(cluster, namespace, "shown")["status"]
    assert stored["budget"]["kvCacheMemoryBytes"] == 58648166400
    assert stored["ranks"][3]["headroom"] == "4Gi"

    out = cluster.kubectl("get", "llmsvc", "-n", namespace).stdout.splitlines()
    header = out[0].split()
    # kubectl prints the CRD's default columns after NAME (their order: tests/unit/house/test_crd_schema.py)
    crd = yaml.safe_load((REPO / "crds" / "llmservice.yaml").read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert header == ["NAME", *(c["name"].upper() for c in columns if not c.get("priority"))]
    assert len(header) == 12
    # cells by the header's columns: PODS is empty for one pod per replica
    starts = [m.start() for m in re.finditer(r"\S+", out[0])]
    row = [out[1][a:b].strip() for a, b in zip(starts, [*starts[1:], len(out[1])], strict=True)]
    assert row[:11] == [
        "shown",
        "meta-llama/Meta-Llama-3-70B",
        "4",
        "1",  # PP
        "",  # PODS: one pod per replica
        "1/1",
        "54.6Gi",
        "1.4Gi",
        "812Mi",
        "rank 2",
        "Running",
    ]

    wide = cluster.kubectl("get", "llmservice", "-n", namespace, "-o", "wide").stdout.splitlines()[0].split()
    assert wide[:12] == header
    assert wide[12:] == ["MAX-CONCURRENCY", "BUDGET-SOURCE", "IMAGE", "SIZING", "RULES"]


def test_status_history_is_bounded(cluster: ControlPlane, crd: str, namespace: str) -> None:
    assert apply(cluster, namespace, minimal("bounded")).returncode == 0
    item = STATUS["remediations"][0]
    r = patch(
        cluster, namespace, "bounded", {"status": {"remediations": [item] * 21}}, "--subresource=status"
    )
    assert r.returncode != 0
    assert "status.remediations: Too many: 21: must have at most 20 items" in r.stderr
    r = patch(
        cluster, namespace, "bounded", {"status": {"remediations": [item] * 20}}, "--subresource=status"
    )
    assert r.returncode == 0, r.stderr


def test_status_fields_are_typed(cluster: ControlPlane, crd: str, namespace: str) -> None:
    assert apply(cluster, namespace, minimal("typed")).returncode == 0
    r = patch(cluster, namespace, "typed", {"status": {"ranks": [{"rank": "zero"}]}}, "--subresource=status")
    assert r.returncode != 0
    assert "status.ranks[0].rank" in r.stderr
    r = patch(
        cluster,
        namespace,
        "typed",
        {"status": {"conditions": [{"type": "Ready", "status": "Maybe"}]}},
        "--subresource=status",
    )
    assert r.returncode != 0
    assert 'Unsupported value: "Maybe"' in r.stderr


def test_kubectl_explain_reads_well(cluster: ControlPlane, crd: str) -> None:
    out = cluster.kubectl("explain", "llmservice.spec.memory").stdout
    for field in (
        "gpuMemoryUtilization",
        "kvCacheMemoryBytes",
        "safetyMarginBytes",
        "minHeadroomBytes",
        "reclaim",
    ):
        assert field in out
    assert "Leave gpuMemoryUtilization and" in out
    out = cluster.kubectl("explain", "llmservice.status.ranks").stdout
    assert "headroomBytes" in out and "least headroom" in out


def test_the_oom_levers_survive_the_api_server(cluster: ControlPlane, crd: str, namespace: str) -> None:
    """Every lever rankguard keeps in status (servingFlags, lastKnownGood, a remediation's flags,
    its phase and lever) is in the schema: the API server prunes what is not, and a pruned lever
    would be rolled back on the next pass. spec.remediation.levers is defaulted and bounded."""
    obj = minimal("levers")
    assert apply(cluster, namespace, obj).returncode == 0
    levers = {
        "maxNumSeqs": 64,
        "maxNumBatchedTokens": 2048,
        "maxCudaGraphCaptureSize": 128,
        "enforceEager": True,
    }
    flags = {"kvCacheMemoryBytes": 58648166400, **levers}
    item = {
        "time": "2026-01-01T00:00:00Z",
        "trigger": "CUDAOutOfMemory",
        "action": "LowerMaxNumSeqs",
        "rank": 0,
        "phase": "sampler-warmup",
        "lever": "max-num-seqs",
        "from": 128,
        "to": 64,
        "fromFlags": {**flags, "maxNumSeqs": 128},
        "toFlags": flags,
    }
    status = {
        "servingFlags": flags,
        "lastKnownGood": {"flags": ["--max-num-seqs", "64"], **flags},
        "remediations": [item],
        "pendingRemediation": {
            "id": "r-1",
            "kind": "EnforceEager",
            "fromFlags": flags,
            "toFlags": flags,
            "record": item,
        },
    }
    r = patch(cluster, namespace, "levers", {"status": status}, "--subresource=status")
    assert r.returncode == 0, r.stderr
    stored = get(cluster, namespace, "levers")
    assert {k: stored["status"][k] for k in status} == status
    assert stored["spec"]["remediation"]["levers"] == {
        "minNumSeqs": 8,
        "minNumBatchedTokens": 1024,
        "minCudaGraphCaptureSize": 8,
        "allowEnforceEager": True,
    }
    bad = minimal("bad-levers")
    with_spec(remediation={"levers": {"minNumSeqs": 0}})(bad)
    r = apply(cluster, namespace, bad)
    assert r.returncode != 0 and "spec.remediation.levers.minNumSeqs" in r.stderr


def test_the_memory_trend_survives_the_api_server(cluster: ControlPlane, crd: str, namespace: str) -> None:
    """status.memoryTrend, as the operator writes it for a headroom that falls (slope and hours
    included), is stored whole and read back to the same series: a pruned field would restart the
    series on every pass and the MemoryCreep condition would never judge it."""
    GiB = 2**30
    # three hours of 5-minute samples falling 0.5 GiB an hour from 6 GiB
    samples = tuple((1_780_000_000.0 + 300 * i, 6 * GiB - i * GiB // 24) for i in range(37))
    trend = MemoryTrend(key="tmpl-abc/pod-1,pod-2", samples=samples, rank=3, gpu_bytes=80 * GiB)
    doc = trend.to_status(256 * 2**20)
    assert doc["bytesPerHour"] < 0 and doc["hoursToLine"] > 0  # the figures are there to store
    assert apply(cluster, namespace, minimal("trend")).returncode == 0
    r = patch(cluster, namespace, "trend", {"status": {"memoryTrend": doc}}, "--subresource=status")
    assert r.returncode == 0, r.stderr
    stored = get(cluster, namespace, "trend")["status"]["memoryTrend"]
    assert stored == doc
    assert MemoryTrend.from_status(stored) == trend
