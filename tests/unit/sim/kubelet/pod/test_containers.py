"""What a container's process gets from the node it runs on: the engine release its image tag
names (RANKGUARD_SIM_VLLM_VERSION) and the pod's own IMEX channel folder, with a channel only on
a node that grants one."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rankguard_sim.kubelet.image import build_image
from rankguard_sim.kubelet.pod.containers import PodContainers
from rankguard_sim.physics.gpus import IMEX_CHANNELS_GLOB_ENV
from rankguard_sim.vllm_snapshot import ENGINE_VERSION_ENV, SNAPSHOT_VERSION


def node(tmp: Path, imex_channel: bool) -> Any:
    """The kubelet as a pod's containers see it (kubelet/pod/node.py's PodNode)."""
    return SimpleNamespace(
        workdir=tmp / "node",
        gpu_root=tmp / "gpus",
        hosts_file=tmp / "hosts",
        image=build_image(tmp / "image"),
        image_bin=tmp / "image",
        scenario=None,
        extra_env={},
        imex_channel=imex_channel,
        address="127.0.0.1",
        node_name="n1",
        allocatable={"cpu": "8", "memory": "64Gi"},
        api=SimpleNamespace(lookup_key=None, lookup_object=None),
        take_start_fault=lambda name: {},
    )


def pod(image: str) -> dict[str, Any]:
    return {
        "metadata": {"uid": "0123456789", "namespace": "team-a", "name": "llm-0"},
        "spec": {"containers": [{"name": "vllm", "image": image, "command": ["vllm", "serve", "m"]}]},
    }


def launch_env(tmp: Path, image: str, imex_channel: bool = False) -> dict[str, str]:
    containers = PodContainers(node(tmp, imex_channel), pod(image))
    _, env, _ = containers._launch_plan(containers.slots[0])
    return env


@pytest.mark.parametrize(
    ("image", "played"),
    [
        ("vllm/vllm-openai:v0.34.0", "0.34.0"),
        ("registry:5000/x/vllm:0.34.0-cu129", "0.34.0"),
        ("vllm/vllm-openai:v0.31.0", SNAPSHOT_VERSION),  # older releases play as before
        ("vllm/vllm-openai:latest", None),
        ("vllm/vllm-openai@sha256:abcd", None),
    ],
)
def test_the_image_tag_names_the_release_played(tmp_path: Path, image: str, played: str | None) -> None:
    assert launch_env(tmp_path, image).get(ENGINE_VERSION_ENV) == played


def test_a_pod_finds_an_imex_channel_only_on_a_node_that_grants_one(tmp_path: Path) -> None:
    without = launch_env(tmp_path / "a", "vllm/vllm-openai:v0.34.0")[IMEX_CHANNELS_GLOB_ENV]
    assert str(tmp_path / "a") in without and glob.glob(without) == []
    with_channel = launch_env(tmp_path / "b", "vllm/vllm-openai:v0.34.0", imex_channel=True)[
        IMEX_CHANNELS_GLOB_ENV
    ]
    found = glob.glob(with_channel)
    assert len(found) == 1 and os.access(found[0], os.R_OK)
