"""vLLM 0.34 sizes its own KV cache; rankguard steers it with a reserve (issue 49,
docs/engine-measured.md), end to end.

Two stories side by side in one sandbox (one namespace, two simulated nodes of the same
scenario, both services applied at once: the e2e tier's time), against the real API server, the
operator as a subprocess, the real agent and the fake vLLM, which plays 0.34.0 when the image's
tag says so (the process kubelet sets RANKGUARD_SIM_VLLM_VERSION from it):

- measured: a 0.34 service starts engine-measured (no --kv-cache-memory-bytes, no reserve on a
  clean GPU) and serves; then a process outside the pod grows on one rank's GPU past what vLLM
  left free, the engine's next step runs out, and the operator raises the reserve exactly once
  (RaiseReserve, lever `reserve`): the Event names the neighbour's pid and its GPU, the service is
  Ready again, and a byte budget was never rendered.
- switch: a 0.33 service (pinned, rankguard's --kv-cache-memory-bytes) whose image moves to 0.34
  switches mode with one roll, and back with one roll.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from rankguard_operator.core.engine.sizing_mode import ENGINE_MEASURED, PINNED
from rankguard_operator.core.policy.history import STATUS_ACTIONS
from rankguard_operator.core.policy.tunables import LEVER_RESERVE, T_CUDA_OOM, T_SIZING_CHANGED
from rankguard_sim.physics import gpus
from rankguard_sim.physics.neighbour import Neighbour
from rankguard_sim.world import OperatorProcess
from tests.builders import llmservice

from .conftest import (
    GROUP,
    PLURAL,
    VERSION,
    Sandbox,
    condition,
    get_llmservice,
    side_by_side,
    wait_for,
)

pytestmark = pytest.mark.e2e

GiB = 2**30
# Llama-3-8B at TP2 on 24 GB cards: after 0.34's warm-up and commit, about 1.6 GiB (rank 0,
# beside the API server's context) and 2.1 GiB (rank 1) stay free, and each serving step's
# transient is tens of MiB of that (sim/rankguard_sim/scenarios/llama3-8b-tp2-24gb.yaml)
SCENARIO = "llama3-8b-tp2-24gb"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
IMAGE_033 = "vllm/vllm-openai:v0.33.0"
IMAGE_034 = "vllm/vllm-openai:v0.34.0"
KV_FLAG = "--kv-cache-memory-bytes"
UTIL_FLAG = "--gpu-memory-utilization"
RAISE_RESERVE = STATUS_ACTIONS["raise-reserve"]
# The neighbour: a small allocation when it appears, then a growth past everything vLLM left free
# on that GPU (so the engine's next step cannot allocate its transient), taken as memory frees
NEIGHBOUR_HOLD = 256 * 2**20
GROWTH_BEYOND_FREE = GiB
WAIT_S = 240
STORIES = ("measured", "switch")


@pytest.fixture(scope="module")
def box(
    api: client.ApiClient, operator_process: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Sandbox]:
    """Both nodes and services, started together; each test reads its own."""
    images = {"measured": IMAGE_034, "switch": IMAGE_033}
    stories = {key: (SCENARIO, functools.partial(_service, key, images[key])) for key in STORIES}
    namespace = f"e2e-measured-{uuid.uuid4().hex[:6]}"
    with side_by_side(api, tmp_path_factory.mktemp("measured"), namespace, stories) as box:
        yield box


def _service(key: str, image: str, node: str) -> dict[str, Any]:
    return llmservice(
        key,
        {
            "model": {"name": MODEL},
            "image": image,
            "tensorParallelSize": 2,
            "engine": {"maxModelLen": 8192},
            # no cool-down: the reserve's move follows the OOM at once
            "remediation": {"cooldownSeconds": 0},
            "template": {"spec": {"nodeSelector": {"kubernetes.io/hostname": node}}},
        },
    )


# -- reading the sandbox --------------------------------------------------------------------------


def _svc(box: Sandbox, key: str) -> dict[str, Any]:
    return get_llmservice(box.api, box.namespace, key)


def _status(box: Sandbox, key: str) -> Callable[[], Any]:
    return lambda: (_svc(box, key).get("status"), _owned_args(box, key))


def _ready(svc: dict[str, Any]) -> bool:
    c = condition(svc, "Ready")
    return bool(c and c["status"] == "True" and (svc.get("status") or {}).get("ranks"))


def _sizing(svc: dict[str, Any]) -> dict[str, Any]:
    return dict((svc.get("status") or {}).get("sizing") or {})


def _ooms(svc: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in (svc.get("status") or {}).get("remediations") or [] if r["trigger"] == T_CUDA_OOM]


def _mode_said(box: Sandbox, key: str, svc: dict[str, Any]) -> bool:
    """An Event says the sizing mode moved to status.sizing's, with its why (decide.py `_mode_changed`)."""
    sizing = _sizing(svc)
    said = f"sizing mode now {sizing['mode']} ({sizing['message']})"
    return any(reason == T_SIZING_CHANGED and m.startswith(said) for reason, m in _events(box, key))


def _events(box: Sandbox, key: str) -> list[tuple[str, str]]:
    events = client.CoreV1Api(box.api).list_namespaced_event(
        box.namespace, field_selector=f"involvedObject.name={key},involvedObject.kind=LLMService"
    )
    return [(e.reason or "", e.message or "") for e in events.items]


def _deployment(box: Sandbox, key: str) -> client.V1Deployment:
    return client.AppsV1Api(box.api).read_namespaced_deployment(key, box.namespace)


def _vllm_argv(spec: client.V1PodSpec) -> list[str]:
    vllm = next(c for c in spec.containers if c.name == "vllm")
    return [*(vllm.command or []), *(vllm.args or [])]


def _args(box: Sandbox, key: str) -> list[str]:
    return _vllm_argv(_deployment(box, key).spec.template.spec)


def _owned_args(box: Sandbox, key: str) -> list[list[str]]:
    """Every pod template the Deployment has rolled out (one ReplicaSet each, kept by history)."""
    sets = client.AppsV1Api(box.api).list_namespaced_replica_set(box.namespace).items
    mine = [s for s in sets if any(o.name == key for o in s.metadata.owner_references or [])]
    return [_vllm_argv(s.spec.template.spec) for s in mine]


def _flag(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _rendered(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _wait_svc(box: Sandbox, key: str, what: str, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        svc = _svc(box, key)
        return svc if ok(svc) else None

    found: dict[str, Any] = wait_for(f"{key}: {what}", check, WAIT_S, dump=_status(box, key))
    return found


def _set_image(box: Sandbox, key: str, image: str) -> None:
    client.CustomObjectsApi(box.api).patch_namespaced_custom_object(
        GROUP, VERSION, box.namespace, PLURAL, key, {"spec": {"image": image}}
    )


# -- the stories ----------------------------------------------------------------------------------


def test_a_neighbour_growing_past_what_vllm_left_free_raises_the_reserve_once(box: Sandbox) -> None:
    key = "measured"
    svc = _wait_svc(box, key, "engine-measured and Ready", lambda s: _ready(s) and bool(_sizing(s)))
    sizing = _sizing(svc)
    assert (sizing["mode"], sizing["reason"]) == (ENGINE_MEASURED, "EngineMeasures"), sizing
    argv = _args(box, key)
    # on a clean GPU rankguard renders what vanilla 0.34 runs: no byte budget, no reserve
    assert not _rendered(argv, KV_FLAG) and not _rendered(argv, UTIL_FLAG), argv
    assert not _ooms(svc), svc["status"].get("remediations")
    generation = _deployment(box, key).metadata.generation

    # a process outside the pod appears on rank 1's GPU, then grows past what vLLM left free there
    node = box.nodes[key]
    gpu = next(r["uuid"] for r in svc["status"]["ranks"] if r["rank"] == 1)
    neighbour: Neighbour = node.kubelet.start_neighbour(gpu, NEIGHBOUR_HOLD)
    free = gpus.free_bytes(node.kubelet.gpu_root, gpu)
    neighbour.grow(free + GROWTH_BEYOND_FREE, timeout=None)  # what is free now, the rest once freed

    svc = _wait_svc(
        box,
        key,
        "the reserve raised, rolled out and Ready",
        lambda s: (
            bool(_ooms(s))
            and _deployment(box, key).metadata.generation > generation
            and _serves(box, key, IMAGE_034)
            and _ready(_svc(box, key))
        ),
    )
    svc = _svc(box, key)  # read after the roll, not at the wait's first probe
    [r] = _ooms(svc)  # exactly one remediation, by the reserve
    assert (r["action"], r["lever"]) == (RAISE_RESERVE, LEVER_RESERVE), r
    to = r["toFlags"]
    assert to.get("engineMeasured") is True, r
    assert to.get("kvCacheMemoryBytes") is None, r
    util = to["gpuMemoryUtilization"]
    assert 0 < util < 1, r
    # the neighbour kept what it took: the engine serves beside it with the reserve
    assert neighbour.held() >= NEIGHBOUR_HOLD + free, (neighbour.held(), free)
    st = svc["status"]
    assert st["servingFlags"] == to, st["servingFlags"]
    assert st["remediations"][-1]["action"] == RAISE_RESERVE
    sizing = _sizing(svc)
    assert sizing["mode"] == ENGINE_MEASURED and sizing.get("reserve"), sizing
    # one roll, with the reserve and still no byte budget
    assert _deployment(box, key).metadata.generation == generation + 1
    assert _flag(_args(box, key), UTIL_FLAG) == f"{util:g}", _args(box, key)
    rolled = _owned_args(box, key)
    assert len(rolled) == 2 and not any(_rendered(a, KV_FLAG) for a in rolled), rolled

    # an Event says why: the neighbour by pid, on its GPU
    said = [m for reason, m in _events(box, key) if reason == RAISE_RESERVE]
    assert any(f"pid {neighbour.pid}" in m and gpu in m for m in said), (neighbour.pid, gpu, said)
    # and no second move followed the first
    assert len(_ooms(_svc(box, key))) == 1


def test_an_image_moving_to_034_and_back_switches_the_sizing_mode_with_one_roll_each(box: Sandbox) -> None:
    key = "switch"
    svc = _wait_svc(
        box,
        key,
        "pinned and Ready",
        lambda s: _ready(s) and bool(_sizing(s)) and _serves(box, key, IMAGE_033),
    )
    sizing = _sizing(svc)
    assert (sizing["mode"], sizing["reason"]) == (PINNED, "EngineEstimates"), sizing
    budget = _flag(_args(box, key), KV_FLAG)
    assert budget is not None and int(budget) > 0, _args(box, key)
    generation = _deployment(box, key).metadata.generation

    _set_image(box, key, IMAGE_034)
    svc = _wait_svc(
        box,
        key,
        "engine-measured on 0.34 and Ready",
        lambda s: _sizing(s).get("mode") == ENGINE_MEASURED and _ready(s) and _serves(box, key, IMAGE_034),
    )
    assert _sizing(svc)["reason"] == "EngineMeasures", _sizing(svc)
    assert _deployment(box, key).metadata.generation == generation + 1
    assert _mode_said(box, key, svc), _events(box, key)  # the roll says why
    argv = _args(box, key)
    assert not _rendered(argv, KV_FLAG) and not _rendered(argv, UTIL_FLAG), argv

    _set_image(box, key, IMAGE_033)
    svc = _wait_svc(
        box,
        key,
        "pinned on 0.33 and Ready",
        lambda s: _sizing(s).get("mode") == PINNED and _ready(s) and _serves(box, key, IMAGE_033),
    )
    assert _sizing(svc)["reason"] == "EngineEstimates", _sizing(svc)
    assert _deployment(box, key).metadata.generation == generation + 2
    assert _mode_said(box, key, svc), _events(box, key)
    budget = _flag(_args(box, key), KV_FLAG)
    assert budget is not None and int(budget) > 0, _args(box, key)
    flags = svc["status"]["servingFlags"]
    assert flags.get("kvCacheMemoryBytes") == int(budget) and not flags.get("engineMeasured"), flags
    assert not _ooms(svc), svc["status"].get("remediations")


def _serves(box: Sandbox, key: str, image: str) -> bool:
    """The Deployment runs `image` and every replica of its latest template is up to date and ready."""
    dep = _deployment(box, key)
    vllm = next(c for c in dep.spec.template.spec.containers if c.name == "vllm")
    st = dep.status
    return bool(
        vllm.image == image
        and st is not None
        and st.observed_generation == dep.metadata.generation
        and (st.updated_replicas or 0) == (dep.spec.replicas or 0)
        and (st.ready_replicas or 0) == (dep.spec.replicas or 0)
        and (st.replicas or 0) == (dep.spec.replicas or 0)
    )
