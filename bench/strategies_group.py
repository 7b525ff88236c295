"""A multi-node service for the vLLM 0.34 table: one group of two pods (vLLM --nnodes 2).

`GroupLoop` is strategies_measured's loop for a service with spec.distributed.podsPerGroup 2:
the operator's reconcile step renders two StatefulSets (the leader's, node rank 0, and the
workers'), and the bench plays their controller and the kubelets as
tests/unit/core/step/group_world.py does (one pod per set, made from its template, named by its
ordinal, replaced when the step rolls the set's template). The whole group is one vLLM world,
which the world runs in one process (strategies_measured.run_measured over the 16 GPUs), started
from the leader's command line; each pod's agent reports its own eight ranks by their global
numbers, with the group fields a real agent sends (nnodes, node_rank, local_world_size, tp_size,
pp_size; per rank local_rank, stage, tp_rank).

A crash ends the whole group (vLLM's multi-node engine dies with any of its ranks): the pod that
holds the failing rank carries the agent's termination message, the other is not Ready.

Pure and deterministic (simulated time, no I/O).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rankguard_agent.wire.report import ProbeResult, Report, parse_report
from rankguard_operator.core.names import POD_INDEX_LABEL
from rankguard_operator.core.observe.pods import carried_template_hash
from rankguard_operator.core.render.pod import served_argv
from strategies_measured import MeasuredCase, MeasuredLoop
from strategies_world import WorldRun, crashed, new_pod, with_ready

PODS_PER_GROUP = 2


def group_spec(doc: dict[str, Any]) -> dict[str, Any]:
    """The service as one group of two pods (one replica)."""
    return {**doc, "distributed": {"podsPerGroup": PODS_PER_GROUP}}


class GroupLoop(MeasuredLoop):
    """MeasuredLoop over the StatefulSets of one two-pod group."""

    def __init__(self, case: MeasuredCase, spec_doc: dict[str, Any]) -> None:
        self.pods: list[dict[str, Any]] = []
        super().__init__(case, group_spec(spec_doc))

    # ------------------------------------------------------------------- the operator's view
    def statefulsets(self) -> list[dict[str, Any]]:
        """The sets as the API server returns them, with their controller's status."""
        out = []
        for (kind, name), body in sorted(self.objects.objects.items()):
            if kind != "StatefulSet":
                continue
            s = {**body, "metadata": {**body["metadata"], "uid": f"uid-{name}", "generation": 1}}
            mine = [p for p in self.pods if p["metadata"]["labels"].get("statefulset") == name]
            ready = [p for p in mine if p["status"]["conditions"][0]["status"] == "True"]
            s["status"] = {
                "observedGeneration": 1,
                "replicas": len(mine),
                "readyReplicas": len(ready),
                "updatedReplicas": len(mine),
            }
            out.append(s)
        return out

    def observed(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return list(self.pods), self.statefulsets()

    def report(
        self,
        free: Sequence[int],
        min_free: Sequence[int],
        startup_free: Sequence[int],
        *,
        probe: bool,
        pod: str,
    ) -> Report:
        """Pod `pod`'s agent: its node's ranks (global numbers) with the group's fields."""
        whole = super().report(free, min_free, startup_free, probe=probe, pod=pod)
        node = next(i for i, p in enumerate(self.pods) if p["metadata"]["name"] == pod)
        s = self.scenario
        local = s.world_size // PODS_PER_GROUP
        mine = range(node * local, (node + 1) * local)
        tp = s.tensor_parallel_size
        ranks = [
            dataclasses.replace(r, local_rank=r.rank - node * local, stage=r.rank // tp, tp_rank=r.rank % tp)
            for r in whole.ranks
            if r.rank in mine
        ]
        found = whole.probe
        probe_here = None
        if found is not None:
            probe_here = ProbeResult(
                ok=found.ok,
                backend=found.backend,
                world_size=s.world_size,
                ranks=[r for r in found.ranks if r.rank in mine],
            )
        report = dataclasses.replace(
            whole,
            ranks=ranks,
            probe=probe_here,
            nnodes=PODS_PER_GROUP,
            node_rank=node,
            local_world_size=local,
            tp_size=tp,
            pp_size=s.pipeline_parallel_size,
        )
        return parse_report(report.to_json())

    # ------------------------------------------------- the StatefulSet controller and kubelets
    @property
    def rolled(self) -> bool:
        sets = {b["metadata"]["name"]: b for (k, _), b in self.objects.objects.items() if k == "StatefulSet"}
        if not self.pods or len(sets) != PODS_PER_GROUP:
            return True
        return any(
            carried_template_hash(p)
            != carried_template_hash(sets[p["metadata"]["labels"]["statefulset"]]["spec"]["template"])
            for p in self.pods
        )

    def start_pod(self, run_no: int) -> list[str]:
        """The group's pods from the sets' templates; returns the leader's `vllm` command line."""
        self.pods = []
        for (kind, name), body in sorted(self.objects.objects.items()):
            if kind != "StatefulSet":
                continue
            ordinal = int((body["spec"].get("ordinals") or {}).get("start", 0))
            pod = new_pod(
                body, f"{name}-{ordinal}", f"uid-{name}-{ordinal}-{run_no}", f"10.0.{run_no}.{ordinal + 1}"
            )
            pod["metadata"]["labels"].update({POD_INDEX_LABEL: str(ordinal), "statefulset": name})
            self.pods.append(pod)
        self.pods.sort(key=lambda p: int(p["metadata"]["labels"][POD_INDEX_LABEL]))
        self.pod = self.pods[0]
        return list(served_argv(self.pods[0]["spec"]))

    def pod_ready(self) -> None:
        self.pods = [with_ready(p) for p in self.pods]
        self.pod = self.pods[0]

    def pod_crashed(self, run: WorldRun, restarts: int) -> None:
        local = self.scenario.world_size // PODS_PER_GROUP
        failing = (run.outcome.rank or 0) // local
        out = []
        for i, p in enumerate(self.pods):
            if i == failing:
                out.append(crashed(p, run, restarts=restarts, now=self.now, n_ranks=local))
            else:
                status = {**p["status"], "conditions": [{"type": "Ready", "status": "False"}]}
                out.append({**p, "status": status})
        self.pods = out
        self.pod = self.pods[0]
