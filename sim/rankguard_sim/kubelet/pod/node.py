"""What a pod worker needs from its node: the process kubelet, as the workers see it.

A Protocol rather than the kubelet's class, so that the worker modules never import the
kubelet (which imports them): the import graph stays acyclic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rankguard_sim.kubelet.pod.api import PodApi
from rankguard_sim.kubelet.pod.spec import ImageTable


class PodNode(Protocol):
    node_name: str
    address: str
    allocatable: dict[str, str]
    workdir: Path
    gpu_root: Path
    hosts_file: Path
    image: ImageTable
    image_bin: Path
    scenario: str | None
    extra_env: dict[str, str]
    imex_channel: bool  # its pods can open an IMEX channel
    backoff_base: float
    backoff_cap: float
    grace_cap: float
    stop_grace: float
    api: PodApi

    def warn_throttled(self, msg: str, *args: object) -> None: ...

    def take_start_fault(self, container: str) -> dict[str, str]: ...

    def acquire_gpus(self, uid: str, count: int) -> list[str] | None: ...

    def free_gpus(self) -> list[str]: ...

    def acquire_ip(self, uid: str) -> str: ...

    def set_comm_init(self, uuids: list[str], argv: list[str]) -> None: ...

    def release_pod(self, uid: str) -> None: ...

    def worker_done(self, uid: str, worker: object) -> None: ...
