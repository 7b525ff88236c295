"""An in-memory cluster for a multi-node service's `reconcile.step` tests: the step's effects
carried out as the edge does (step.replay's `Objects`), plus a StatefulSet controller that acts
as Kubernetes' does for the sets rankguard renders (`podManagementPolicy: Parallel`,
`updateStrategy: OnDelete`, `ordinals.start`): missing pods created from the set's template at
once, pods past the set's replicas deleted, a pod's name reused only once its predecessor is
gone, a template change never touching a pod. Pods take their time to terminate, and not all
the same (a leader one tick, a worker three), as engines of different sizes do.

`history` keeps every pod that ever existed at every tick, so a test can assert on every moment
it can see (no group ever runs two templates).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rankguard_agent.wire.report import RankSample, Report
from rankguard_operator.core.names import GROUP_LABEL, POD_INDEX_LABEL, ROLE_LABEL, TEMPLATE_HASH_ANNOTATION
from rankguard_operator.core.status.service_state import ServiceState
from rankguard_operator.core.step import Objects, ReportInput, Settings, Step, World, reconcile
from rankguard_operator.core.units import GiB

SETTINGS = Settings(agent_image="agent:test", stale_after=30.0)
T0 = 1_800_000_000.0
SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Llama-3.1-70B-Instruct"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 8,
    "pipelineParallelSize": 2,
    "replicas": 2,
    "distributed": {"podsPerGroup": 2},
    "engine": {"maxModelLen": 8192},
    "memory": {"gpuMemoryBytes": 80 * GiB},
}


def _hash(obj: Mapping[str, Any]) -> str:
    return str(((obj.get("metadata") or {}).get("annotations") or {}).get(TEMPLATE_HASH_ANNOTATION) or "")


@dataclass
class GroupCluster(Objects):
    spec: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SPEC))
    generation: int = 1
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # by name
    clock: float = T0
    ids: int = 0
    uids: int = 0
    generations: dict[str, int] = field(default_factory=dict)  # StatefulSet name -> generation
    history: list[list[dict[str, Any]]] = field(default_factory=list)  # the pods at every tick
    ready_engines: bool = True  # leaders turn ready once their group is complete
    terminating: dict[str, int] = field(default_factory=dict)  # pod name -> ticks left
    # node name -> labels; the world carries those of the nodes the pods run on, as the edge does
    node_labels: dict[str, dict[str, str]] = field(default_factory=dict)

    # ----------------------------------------------------------------------------- the operator
    def statefulsets(self) -> list[dict[str, Any]]:
        out = []
        for body in self.of_kind("StatefulSet"):
            s = copy.deepcopy(body)
            name = s["metadata"]["name"]
            s["metadata"]["uid"] = f"uid-{name}"
            s["metadata"]["generation"] = self.generations.get(name, 1)
            # the controller's own count, for the spec it has seen (this one: it acts at once)
            mine = [p for p in self.pods.values() if p["metadata"]["labels"].get("statefulset") == name]
            s["status"] = {"observedGeneration": s["metadata"]["generation"], "replicas": len(mine)}
            out.append(s)
        return out

    def world(self, reports: tuple[ReportInput, ...] = ()) -> World:
        self.ids += 1
        return World(
            name="svc",
            namespace="ns",
            uid="uid-svc",
            generation=self.generation,
            spec=copy.deepcopy(self.spec),
            now=self.clock,
            new_id=f"rid-{self.ids}",
            deployment=copy.deepcopy(self.deployment),
            statefulsets=self.statefulsets(),
            pods=[copy.deepcopy(p) for _, p in sorted(self.pods.items())],
            reports=reports,
            node_labels={
                n: dict(self.node_labels[n])
                for n in sorted({p["spec"]["nodeName"] for p in self.pods.values()})
                if n in self.node_labels
            },
        )

    def state(self) -> ServiceState:
        return ServiceState.from_status(copy.deepcopy(self.status))

    def run(self, reports: tuple[ReportInput, ...] = (), crash_after: int | None = None) -> Step:
        """One pass of the operator; with `crash_after`, it dies after that many effects."""
        before = {n: copy.deepcopy(b) for (k, n), b in self.objects.items() if k == "StatefulSet"}
        step = reconcile.step(self.state(), self.world(reports), SETTINGS)
        for i, effect in enumerate(step.effects):
            if crash_after is not None and i >= crash_after:
                break
            self.carry_out(effect)
        for (kind, name), body in self.objects.items():
            if kind == "StatefulSet" and before.get(name, {}).get("spec") != body.get("spec"):
                self.generations[name] = self.generations.get(name, 0) + 1
        self.clock += 2.0
        return step

    # ----------------------------------------------------------------- the StatefulSet controller
    def tick(self) -> None:
        """One round of the StatefulSet controller and the kubelets."""
        for name in [n for n, p in self.pods.items() if p["metadata"].get("deletionTimestamp")]:
            left = self.terminating.get(name, 1) - 1
            if left <= 0:
                del self.pods[name]  # terminated
                self.terminating.pop(name, None)
            else:
                self.terminating[name] = left
        sets = {n: b for (k, n), b in self.objects.items() if k == "StatefulSet"}
        for set_name, s in sets.items():
            start = (s["spec"].get("ordinals") or {}).get("start", 0)
            wanted = {f"{set_name}-{o}": o for o in range(start, start + s["spec"]["replicas"])}
            for pod_name, ordinal in wanted.items():
                if pod_name not in self.pods:
                    self.pods[pod_name] = self._new_pod(pod_name, ordinal, s)
            for pod_name, p in self.pods.items():
                if p["metadata"]["labels"].get("statefulset") == set_name and pod_name not in wanted:
                    self._delete(p)
        for p in self.pods.values():
            if p["metadata"]["labels"].get("statefulset") not in sets:
                self._delete(p)  # its set was deleted
        self._readiness()
        self.history.append([copy.deepcopy(p) for p in self.pods.values()])

    def _delete(self, p: dict[str, Any]) -> None:
        if not p["metadata"].get("deletionTimestamp"):
            p["metadata"]["deletionTimestamp"] = "2027-01-01T00:00:00Z"
            self.terminating[p["metadata"]["name"]] = 1 if role_of(p) == "leader" else 3

    def _new_pod(self, name: str, ordinal: int, s: Mapping[str, Any]) -> dict[str, Any]:
        self.uids += 1
        template = s["spec"]["template"]
        labels = {
            **template["metadata"]["labels"],
            POD_INDEX_LABEL: str(ordinal),
            "statefulset": s["metadata"]["name"],
        }
        return {
            "metadata": {
                "name": name,
                "uid": f"uid-{name}-{self.uids}",
                "labels": labels,
                "annotations": dict(template["metadata"]["annotations"]),
            },
            "spec": {"nodeName": "node-1"},
            "status": {
                "podIP": f"10.0.0.{self.uids % 250 + 1}",
                "conditions": [{"type": "Ready", "status": "False"}],
                "containerStatuses": [{"name": "vllm", "restartCount": 0, "state": {"running": {}}}],
            },
        }

    def _readiness(self) -> None:
        """A group's pods are ready once all of its pods run one template (the rendezvous
        completes), when `ready_engines`."""
        by_group: dict[str, list[dict[str, Any]]] = {}
        for p in self.pods.values():
            by_group.setdefault(p["metadata"]["labels"][GROUP_LABEL], []).append(p)
        size = self.spec["distributed"]["podsPerGroup"]
        for members in by_group.values():
            live = [p for p in members if not p["metadata"].get("deletionTimestamp")]
            joined = len(live) == size and len({_hash(p) for p in live}) == 1
            joined = joined and all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in live)
            for p in members:
                ok = self.ready_engines and joined and not p["metadata"].get("deletionTimestamp")
                p["status"]["conditions"] = [{"type": "Ready", "status": "True" if ok else "False"}]

    def settle(self, passes: int = 40) -> None:
        """Operator passes and controller ticks until nothing changes (or `passes` run out)."""
        for _ in range(passes):
            step = self.run()
            self.tick()
            quiet = not any(type(e).__name__ in ("ApplyObject", "DeleteObject") for e in step.effects)
            if (
                quiet
                and self.groups_ready()
                and not any(p["metadata"].get("deletionTimestamp") for p in self.pods.values())
            ):
                return

    # --------------------------------------------------------------------------- what we assert
    def group_pods(self, group: int) -> list[dict[str, Any]]:
        return [p for p in self.pods.values() if p["metadata"]["labels"][GROUP_LABEL] == str(group)]

    def groups_ready(self) -> bool:
        n = self.spec.get("replicas", 1)
        size = self.spec["distributed"]["podsPerGroup"]
        for g in range(n):
            pods = self.group_pods(g)
            if len(pods) != size or not all(
                c["status"] == "True" for p in pods for c in p["status"]["conditions"] if c["type"] == "Ready"
            ):
                return False
        return True

    def mixed_moments(self) -> list[str]:
        """Every moment seen where one group's pods (terminating ones too) ran two templates."""
        out = []
        for t, pods in enumerate(self.history):
            groups: dict[str, set[str]] = {}
            for p in pods:
                groups.setdefault(p["metadata"]["labels"][GROUP_LABEL], set()).add(_hash(p))
            out += [f"tick {t}: group {g} runs {sorted(h)}" for g, h in groups.items() if len(h) > 1]
        return out

    def lose(self, pod_name: str) -> None:
        """The pod is gone at once (deleted with no grace, its node lost)."""
        del self.pods[pod_name]
        self.terminating.pop(pod_name, None)

    def restart(self, pod_name: str) -> None:
        """The pod's vLLM container ended and the kubelet started it again."""
        cs = self.pods[pod_name]["status"]["containerStatuses"][0]
        cs["restartCount"] += 1


def leader_of(group: int) -> str:
    return f"svc-g{group}-0"


def role_of(p: Mapping[str, Any]) -> str:
    return str(p["metadata"]["labels"][ROLE_LABEL])


def group_report(pod: str, ranks: range, min_free: Mapping[int, int], at: float) -> Report:
    """An agent's report from one pod of a group: its ranks by their global numbers."""
    return Report(
        version=1,
        agent_version="0.1.0",
        timestamp=at,
        ranks=[
            RankSample(
                rank=r,
                uuid=f"GPU-{pod}-{r}",
                total_bytes=80 * GiB,
                used_bytes=80 * GiB - (min_free.get(r, 10 * GiB) + GiB),
                free_bytes=min_free.get(r, 10 * GiB) + GiB,
                min_free_bytes=min_free.get(r, 10 * GiB),
                window_seconds=10.0,
            )
            for r in ranks
        ],
    )
