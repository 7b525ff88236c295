"""An in-memory cluster for `reconcile.step` tests: it carries out the step's effects the way
the edge executor does (status merge patches as the API server applies them, Deployment
applies with generations, named Events), plus the pods, reports and termination records the
tests feed it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rankguard_agent.wire import termination as tm
from rankguard_agent.wire.report import RankSample, Report
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.names import (
    FLAGS_ANNOTATION,
    TEMPLATE_HASH_ANNOTATION,
)
from rankguard_operator.core.observe.pods import deployment_template_hash
from rankguard_operator.core.render.pod import served_argv
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import Objects, ReportInput, Settings, Step, World, reconcile
from rankguard_operator.core.units import GiB

SETTINGS = Settings(agent_image="agent:test", stale_after=30.0)
T0 = 1_800_000_000.0
SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 2,
    "engine": {"maxModelLen": 8192},
    "memory": {"gpuMemoryBytes": 80 * GiB},
    "agent": {"port": 9404},
}


def cuda_oom_record(rank: int = 0) -> dict[str, Any]:
    message = tm.TerminationMessage(
        reason=tm.CUDA_OOM,
        exit_code=1,
        rank=rank,
        gpu_index=rank,
        requested_bytes=2 * GiB,
        free_bytes=GiB,
        total_bytes=80 * GiB,
        detail="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
    ).to_json()
    return {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}


def engine_error_record(detail: str = "ValueError: the engine refused its configuration") -> dict[str, Any]:
    """A run that ended with an engine error (no memory cause), as the launcher writes it."""
    message = tm.TerminationMessage(reason=tm.ENGINE_ERROR, exit_code=1, detail=detail).to_json()
    return {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}


def kv_too_small_record() -> dict[str, Any]:
    """vLLM refused to start: one request of max_model_len does not fit the KV budget."""
    message = tm.TerminationMessage(
        reason=tm.KV_CACHE_TOO_SMALL,
        exit_code=1,
        detail="ValueError: To serve at least one request with the models's max seq len (8192), "
        "(1.00 GiB KV cache is needed, which is larger than the available KV cache memory (0.50 GiB).",
    ).to_json()
    return {"exitCode": 1, "reason": "Error", "message": message, "finishedAt": "2027-01-15T08:00:00Z"}


@dataclass
class Cluster(Objects):
    """What the API server holds for one LLMService, changed only through effects (carried out
    as step.replay does), plus the pods, reports and clock the tests feed it."""

    spec: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SPEC))
    generation: int = 1
    pods: list[dict[str, Any]] = field(default_factory=list)
    clock: float = T0
    ids: int = 0

    def world(
        self,
        reports: tuple[ReportInput, ...] = (),
        node_labels: Mapping[str, Mapping[str, str]] | None = None,
    ) -> World:
        self.ids += 1
        return World(
            name="svc",
            namespace="ns",
            uid="uid-1",
            generation=self.generation,
            spec=copy.deepcopy(self.spec),
            now=self.clock,
            new_id=f"rid-{self.ids}",
            deployment=copy.deepcopy(self.deployment),
            pods=copy.deepcopy(self.pods),
            reports=reports,
            node_labels=dict(node_labels or {}),
        )

    def state(self) -> ServiceState:
        return ServiceState.from_status(copy.deepcopy(self.status))

    def run(self, crash_after: int | None = None, **kw: Any) -> Step:
        """One pass; with `crash_after`, the operator dies after that many effects."""
        step = reconcile.step(self.state(), self.world(**kw), SETTINGS)
        for i, effect in enumerate(step.effects):
            if crash_after is not None and i >= crash_after:
                break
            self.carry_out(effect)
        self.clock += 2.0
        return step

    def controller_done(self) -> None:
        """The Deployment controller rolled every replica out and the pods are ready."""
        assert self.deployment is not None
        d = self.deployment
        n = d["spec"]["replicas"]
        d["status"] = {
            "observedGeneration": d["metadata"]["generation"],
            "replicas": n,
            "updatedReplicas": n,
            "readyReplicas": n,
            "availableReplicas": n,
        }
        template = d["spec"]["template"]
        self.pods = [
            pod(f"svc-{d['metadata']['generation']}", template["metadata"]["annotations"], ready=True)
        ]

    def template_changed(self) -> bool:
        """The Deployment holds another template than the pods were created from."""
        live = deployment_template_hash(self.deployment)
        return any(p["metadata"]["annotations"].get(TEMPLATE_HASH_ANNOTATION) != live for p in self.pods)

    def kv_rolls(self) -> list[int]:
        """The distinct KV budgets the Deployment was rolled to, in order."""
        out: list[int] = []
        for body in self.deployments_applied:
            kv = flags_of(body).kv_cache_memory_bytes
            assert kv is not None
            if not out or out[-1] != kv:
                out.append(kv)
        return out


def pod(name: str, annotations: Mapping[str, str], *, ready: bool, terminated: Any = None) -> dict[str, Any]:
    status: dict[str, Any] = {
        "podIP": "127.0.0.9",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        "containerStatuses": [
            {"name": "vllm", "restartCount": 1 if terminated else 0, "state": {"running": {}}}
        ],
    }
    if terminated is not None:
        status["containerStatuses"][0]["lastState"] = {"terminated": terminated}
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "annotations": dict(annotations)},
        "status": status,
    }


def crash_loop(c: Cluster, terminated: Mapping[str, Any], run: int) -> None:
    """Run `run` (0 = the first) of the serving pod's vLLM ended with `terminated`: the pod is
    restarting (not ready) and the Deployment counts no ready replica."""
    p = c.pods[0]
    meta = p["metadata"]
    crashed = pod(meta["name"], meta["annotations"], ready=False, terminated=dict(terminated))
    crashed["metadata"]["uid"] = p["metadata"]["uid"]  # the same pod, another run
    crashed["status"]["containerStatuses"][0]["restartCount"] = run + 1
    c.pods = [crashed]
    assert c.deployment is not None
    c.deployment["status"] = {**c.deployment.get("status", {}), "readyReplicas": 0, "availableReplicas": 0}


def flags_of(deployment: Mapping[str, Any]) -> ServingFlags:
    raw = deployment["spec"]["template"]["metadata"]["annotations"][FLAGS_ANNOTATION]
    import json

    flags = ServingFlags.from_status(json.loads(raw))
    assert flags is not None
    return flags


def report(min_free: tuple[int, ...], at: float) -> Report:
    ranks = [
        RankSample(
            rank=r,
            uuid=f"GPU-{r}",
            total_bytes=80 * GiB,
            used_bytes=80 * GiB - (m + GiB),
            free_bytes=m + GiB,
            min_free_bytes=m,
            window_seconds=10.0,
        )
        for r, m in enumerate(min_free)
    ]
    return Report(version=1, agent_version="0.1.0", timestamp=at, ranks=ranks)


def running() -> Cluster:
    """An LLMService applied and Ready: first pass, rollout done, a steady pass."""
    c = Cluster()
    c.run()
    c.controller_done()
    c.run()
    return c


def crash_the_pod(c: Cluster) -> str:
    """The serving pod's vLLM dies of a CUDA OOM on rank 0; returns the termination key."""
    p = c.pods[0]
    c.pods = [
        pod(p["metadata"]["name"], p["metadata"]["annotations"], ready=False, terminated=cuda_oom_record())
    ]
    return f"{c.pods[0]['metadata']['uid']}/vllm/0"


def vllm_argv(deployment: Mapping[str, Any]) -> list[str]:
    """The `vllm` arguments the Deployment's pods run."""
    return served_argv(deployment["spec"]["template"]["spec"])
