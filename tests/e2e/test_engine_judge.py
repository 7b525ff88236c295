"""End to end: every engine argument judged as the engine that will run it judges it (issue 51),
one test per layer the sandbox has. Refused at apply: what the static rules catch never reaches
a GPU (InvalidSpec, nothing deployed). Refused in the pod: what only the image's own vLLM refuses
(the simulated image's `vllm` package, judging as the release it plays, sim/vllm_standin) ends the
container before the engine starts, and the service is Degraded EngineRefusedArguments quoting
vLLM, with no remediation and no roll; the spec edit that removes the argument rolls once and the
service turns Ready. (The real engine's judge is the engine tier's: tests/engine.)
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from rankguard_sim.fake_vllm.config_checks import model_refusal
from rankguard_sim.vllm_snapshot import playing
from rankguard_sim.waiting import wait_for
from tests.builders import llmservice

from .conftest import (
    GROUP,
    PLURAL,
    VERSION,
    apply_service,
    condition,
    degraded_as,
    deployments,
    events,
    get_llmservice,
    wait_degraded,
)

pytestmark = pytest.mark.e2e

SPEC: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
    "image": "vllm/vllm-openai:v0.33.0",
    "tensorParallelSize": 2,
    "engine": {"maxModelLen": 8192},
    # the card's size given, so rankguard plans from the start (no replan roll to count)
    "memory": {"gpuMemoryBytes": round(23.58 * 2**30)},
}
# What the static rules pass and vLLM refuses when it builds the model's configuration: a
# generative model asked to run as a pooling model it may not be converted to (vLLM's ModelConfig;
# the sandbox's judge plays the recorded refusal, docs/sim-world.md "The in-pod cause")
ARCHITECTURE = "LlamaForCausalLM"
RUNNER, CONVERT = "pooling", "none"
REFUSED_ARGS = ["--runner", RUNNER, "--convert", CONVERT]


def service(name: str, **engine: Any) -> dict[str, Any]:
    return llmservice(name, {**SPEC, "engine": {**SPEC["engine"], **engine}})


def restarts(api: client.ApiClient, ns: str, name: str) -> int:
    pods = client.CoreV1Api(api).list_namespaced_pod(ns, label_selector=f"app.kubernetes.io/instance={name}")
    return max(
        (cs.restart_count for p in pods.items for cs in (p.status.container_statuses or [])), default=0
    )


def test_an_argument_the_static_rules_refuse_never_reaches_a_pod(
    api: client.ApiClient, e2e_namespace: str
) -> None:
    # "0" is not "not set": vLLM would serve on a unix socket named 0, with no HTTP at all
    apply_service(api, e2e_namespace, service("uds", extraArgs=["--uds", "0"]))
    svc = wait_degraded(api, e2e_namespace, "uds", "InvalidSpec", 60)
    assert svc["status"]["phase"] == "Failed"
    assert "--uds" in condition(svc, "Degraded")["message"]  # type: ignore[index]
    assert len(events(api, e2e_namespace, "uds", "InvalidSpec")) == 1
    assert deployments(api, e2e_namespace) == []


def test_an_argument_only_the_pods_vllm_refuses_is_degraded_with_its_words_and_one_fix_rolls_once(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    ns = e2e_namespace
    with playing(SPEC["image"].rsplit(":v", 1)[1]):  # the release the image plays
        said = model_refusal((ARCHITECTURE,), RUNNER, CONVERT)
    assert said, "the played release records no refusal for this cause (config_checks.json)"
    make_node("llama3-8b-tp2-24gb", time_scale=4)
    apply_service(api, ns, service("judged", extraArgs=REFUSED_ARGS))
    svc = wait_degraded(api, ns, "judged", "EngineRefusedArguments", 180)
    message = condition(svc, "Degraded")["message"]  # type: ignore[index]
    # vLLM's own words (folded, bounded), and what to change
    assert " ".join(said.split())[:200] in message and "spec.engine.extraArgs" in message, message
    assert svc["status"]["phase"] == "Degraded"
    [before] = deployments(api, ns)
    wait_for("two more runs refused", lambda: restarts(api, ns, "judged") >= 2, 180)
    svc = get_llmservice(api, ns, "judged")
    # said once; never an engine error, a crash loop or an OOM; nothing remediated, nothing rolled
    assert degraded_as(api, ns, "judged", "EngineRefusedArguments")
    assert len(events(api, ns, "judged", "EngineRefusedArguments")) == 1
    for other in ("EngineError", "EngineCrashLoop", "RolledBack", "RolloutFailed"):
        assert events(api, ns, "judged", other) == [], other
    assert not svc["status"].get("remediations") and not svc["status"].get("pendingRemediation")
    [after] = deployments(api, ns)
    assert after.metadata.generation == before.metadata.generation

    # the person's fix: the argument removed; exactly one roll, then Ready
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, "judged", {"spec": {"engine": {"extraArgs": None}}}
    )

    def ready() -> dict[str, Any] | None:
        svc = get_llmservice(api, ns, "judged")
        r, d = condition(svc, "Ready"), condition(svc, "Degraded")
        return svc if r and r["status"] == "True" and d and d["status"] == "False" else None

    wait_for("Ready after the fix", ready, 300, dump=lambda: get_llmservice(api, ns, "judged").get("status"))
    [fixed] = deployments(api, ns)
    assert fixed.metadata.generation == before.metadata.generation + 1
    assert not get_llmservice(api, ns, "judged")["status"].get("remediations")
