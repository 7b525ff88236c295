"""`spec.distributed`: one model served across several pods (a group), as vLLM 0.33's native
multi-node mode runs it (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`,
`--headless` on every pod but the leader, the mp executor).

Without the block an LLMService is one pod per replica, as before. With it, each replica is a
group of `podsPerGroup` pods holding tensorParallelSize × pipelineParallelSize GPUs between
them, an equal whole number on each pod; global rank = node rank × GPUs per pod + local rank
(TP fastest, PP slowest), so the last pipeline stage lives on the last pod.

What cannot work is refused here with its own message (the CRD's CEL rules say the same at
apply): a split that does not divide over the pods, more pods than GPUs, a rendezvous port
that is one of the pod's other ports, and, in extraArgs, the options rankguard now sets per pod
(core/engine/owned_flags.GROUP_OWNED).

Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rankguard_operator.core.names import VLLM_HTTP_PORT
from rankguard_operator.core.spec.fields import (
    SpecError,
    choice_field,
    int_field,
    required_int,
    section,
    str_field,
)
from rankguard_operator.core.spec.template import check_metadata, string_map

Workload = Literal["StatefulSet", "LeaderWorkerSet"]
WORKLOADS: tuple[str, ...] = ("StatefulSet", "LeaderWorkerSet")
# vLLM's own `--master-port` default (its snapshot says 29501): the port the leader listens on
# for the rendezvous and the workers dial.
DEFAULT_RENDEZVOUS_PORT = 29501
MAX_PODS_PER_GROUP = 64
# NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME: interface names (15 characters in Linux), a prefix
# (`eth`), `=name` for an exact match or `^name` to exclude, comma-separated.
_IFNAME = re.compile(r"^[=^]?[A-Za-z0-9_.:-]{1,15}(,[=^]?[A-Za-z0-9_.:-]{1,15}){0,7}$")
WORKER_TEMPLATE_FIELDS = ("nodeSelector", "tolerations")
_TOLERATION_KEYS = {"key", "operator", "value", "effect", "tolerationSeconds"}


@dataclass(frozen=True)
class DistributedSpec:
    pods_per_group: int
    workload: Workload = "StatefulSet"
    rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT
    timeout_seconds: int | None = None  # vLLM's --distributed-timeout-seconds; None: its default
    network_interface: str | None = None
    # spec.distributed.workerTemplate as canonical JSON (metadata, nodeSelector, tolerations)
    worker_template: str = "{}"

    @property
    def worker_overrides(self) -> dict[str, Any]:
        parsed = json.loads(self.worker_template)
        assert isinstance(parsed, dict)
        return parsed


def _worker_template(raw: Any) -> str:
    where = "spec.distributed.workerTemplate"
    if raw is None:
        return "{}"
    if not isinstance(raw, Mapping):
        raise SpecError(f"{where} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"metadata", "spec"})
    if unknown:
        raise SpecError(f"{where} takes metadata and spec, not {', '.join(unknown)}")
    out: dict[str, Any] = {}
    meta = raw.get("metadata") or {}
    if not isinstance(meta, Mapping):
        raise SpecError(f"{where}.metadata must be an object")
    checked = check_metadata(meta, f"{where}.metadata")
    if checked:
        out["metadata"] = checked
    pod = raw.get("spec") or {}
    if not isinstance(pod, Mapping):
        raise SpecError(f"{where}.spec must be an object")
    unknown = sorted(set(pod) - set(WORKER_TEMPLATE_FIELDS))
    if unknown:
        raise SpecError(
            f"{where}.spec.{unknown[0]} cannot be set: the worker pods take "
            f"{', '.join(WORKER_TEMPLATE_FIELDS)} of their own; everything else comes from spec.template, "
            "like the leader's"
        )
    spec_out: dict[str, Any] = {}
    if "nodeSelector" in pod:
        spec_out["nodeSelector"] = string_map(pod, "nodeSelector", f"{where}.spec")
    if "tolerations" in pod:
        tolerations = pod["tolerations"]
        if not isinstance(tolerations, Sequence) or isinstance(tolerations, str):
            raise SpecError(f"{where}.spec.tolerations must be a list")
        for i, t in enumerate(tolerations):
            if not isinstance(t, Mapping) or set(t) - _TOLERATION_KEYS:
                raise SpecError(
                    f"{where}.spec.tolerations[{i}] must be a toleration "
                    f"({', '.join(sorted(_TOLERATION_KEYS))})"
                )
        spec_out["tolerations"] = [dict(t) for t in tolerations]
    if spec_out:
        out["spec"] = spec_out
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


def parse_distributed(spec: Mapping[str, Any], tp: int, pp: int, agent_port: int) -> DistributedSpec | None:
    """spec.distributed, or None for one pod per replica."""
    if spec.get("distributed") is None:
        return None
    where = "spec.distributed"
    d = section(spec, "distributed", "spec")
    unknown = sorted(
        set(d)
        - {
            "podsPerGroup",
            "workload",
            "rendezvousPort",
            "timeoutSeconds",
            "networkInterface",
            "workerTemplate",
        }
    )
    if unknown:
        raise SpecError(f"{where} has no field {unknown[0]!r}")
    if "podsPerGroup" not in d:
        raise SpecError(
            f"{where}.podsPerGroup is required: the number of pods that serve one replica together"
        )
    pods = required_int(d, "podsPerGroup", where, 2, lo=2, hi=MAX_PODS_PER_GROUP)
    world = tp * pp
    if pods > world:
        raise SpecError(
            f"{where}.podsPerGroup ({pods}) is more pods than the replica's GPUs "
            f"(spec.tensorParallelSize × spec.pipelineParallelSize = {tp} × {pp} = {world}): every pod needs "
            "at least one GPU"
        )
    if world % pods:
        raise SpecError(
            f"spec.tensorParallelSize × spec.pipelineParallelSize ({tp} × {pp} = {world} GPUs) does not "
            f"divide over {where}.podsPerGroup ({pods}): each pod must hold the same whole number of GPUs "
            f"({world}/{pods} is not whole, and vLLM refuses an --nnodes that does not divide its world "
            f"size); use a pod count that divides {world}"
        )
    port = required_int(d, "rendezvousPort", where, DEFAULT_RENDEZVOUS_PORT, lo=1, hi=65535)
    if port in (VLLM_HTTP_PORT, agent_port):
        raise SpecError(
            f"{where}.rendezvousPort {port} is already the pod's "
            f"{'vLLM HTTP' if port == VLLM_HTTP_PORT else 'agent'} port; pick another "
            f"(default {DEFAULT_RENDEZVOUS_PORT})"
        )
    iface = str_field(d, "networkInterface", where, None)
    if iface is not None and not _IFNAME.match(iface):
        raise SpecError(
            f"{where}.networkInterface {iface!r} is not an interface list NCCL and Gloo read "
            "(e.g. eth0, =eth0, ^docker,lo: up to 8 names of at most 15 characters)"
        )
    workload = choice_field(d, "workload", where, WORKLOADS[0], WORKLOADS)
    return DistributedSpec(
        pods_per_group=pods,
        workload="LeaderWorkerSet" if workload == "LeaderWorkerSet" else "StatefulSet",
        rendezvous_port=port,
        timeout_seconds=int_field(d, "timeoutSeconds", where, None, lo=10, hi=86400),
        network_interface=iface,
        worker_template=_worker_template(d.get("workerTemplate")),
    )
