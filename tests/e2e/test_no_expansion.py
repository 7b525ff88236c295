"""End to end (issue 30): a `$(X)` in spec.engine.extraArgs, with spec.template's env setting
X to another KV budget, reaches vLLM as the literal text. The engine process's own argv (read
from /proc on the simulated node) is byte for byte what the LLMService's status records, and
the budget it runs with is rankguard's, not the one the env smuggled in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from .conftest import apply_service, condition, example, get_llmservice, wait_for

pytestmark = pytest.mark.e2e

SMUGGLED = "--kv-cache-memory-bytes=2147483648"
EXTRA = ["--served-model-name", "llama3", "$(X)"]
PINNED = 20 * 2**30  # a budget that fits the scenario's GPUs: no remediation roll to wait for


def _argv(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []  # the process ended between the listing and the read
    return [a.decode() for a in raw.split(b"\0")[:-1]]


def _engine_argv(pids: list[int]) -> list[str] | None:
    """The vLLM process's arguments from `serve` on (the agent's launcher, which also names
    `serve` after its `--`, is not it)."""
    for pid in pids:
        argv = _argv(pid)
        if "serve" in argv and "launch" not in argv:
            return argv[argv.index("serve") :]
    return None


def test_a_reference_in_extra_args_reaches_vllm_literally_as_status_says(
    api: client.ApiClient, e2e_namespace: str, make_node: Any
) -> None:
    node = make_node("llama3-70b-tp4", time_scale=4)
    doc = example()
    name = doc["metadata"]["name"]
    doc["spec"]["engine"] = {**doc["spec"].get("engine", {}), "extraArgs": EXTRA}
    doc["spec"]["memory"] = {"kvCacheMemoryBytes": PINNED}
    doc["spec"]["template"] = {
        "spec": {"containers": [{"name": "vllm", "env": [{"name": "X", "value": SMUGGLED}]}]}
    }
    apply_service(api, e2e_namespace, doc)

    def ready_with_flags() -> list[str] | None:
        svc = get_llmservice(api, e2e_namespace, name)
        ready = condition(svc, "Ready")
        flags = ((svc.get("status") or {}).get("lastKnownGood") or {}).get("flags")
        return flags if ready and ready["status"] == "True" and flags else None

    status_flags = wait_for(
        "Ready and the flags in status",
        ready_with_flags,
        240,
        dump=lambda: get_llmservice(api, e2e_namespace, name).get("status"),
    )
    pods = client.CoreV1Api(api).list_namespaced_pod(
        e2e_namespace, label_selector="app.kubernetes.io/name=vllm"
    )
    [pod] = [p for p in pods.items if p.metadata.deletion_timestamp is None]
    engine = wait_for(
        "the engine process",
        lambda: _engine_argv(node.kubelet.pod_pids(e2e_namespace, pod.metadata.name)),
        60,
    )
    assert engine == status_flags
    assert engine[-3:] == EXTRA and SMUGGLED not in engine
    assert engine[engine.index("--kv-cache-memory-bytes") + 1] == str(PINNED)
    # the pod spec holds the escape the kubelet undoes
    command = pod.spec.containers[0].command
    assert "$$(X)" in command and "$(X)" not in command
