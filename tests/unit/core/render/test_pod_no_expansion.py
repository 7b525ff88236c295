"""Issue 30: nothing the spec says is expanded by the kubelet, mount paths are compared after
normalising, and a safety margin no GPU can leave is refused before anything is deployed.

The kubelet here is the sandbox's (`rankguard_sim.kubelet.pod.spec.expand`, the rules of the
real one: `$$` is `$`, `$(NAME)` is NAME's value), so a rendered command is read the way a node
would read it, with the env a template can add.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.render.deployment import render_deployment
from rankguard_operator.core.render.pod import (
    GroupNode,
    kube_argv,
    kube_expand,
    kube_text,
    pod_spec,
    served_argv,
    vllm_args,
)
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import ServiceSpec, parse_spec
from rankguard_operator.core.status.build import last_known_good_status
from rankguard_operator.core.units import GiB
from rankguard_sim.kubelet.pod.spec import expand
from tests.unit.reconcile_world import SPEC, Cluster

SMALL_KV = "--kv-cache-memory-bytes=2147483648"
# the red team's extraArgs: `$(X)` would become a second --kv-cache-memory-bytes
EXTRA = ["--served-model-name", "llama3", "$(X)"]
TEMPLATE_ENV = {"X": SMALL_KV, "HOME": "/root"}


def spec_of(**changes: Any) -> ServiceSpec:
    doc = copy.deepcopy(SPEC)
    doc.update(copy.deepcopy(changes))
    return parse_spec(doc)


def vllm_container(spec: ServiceSpec, flags: ServingFlags) -> dict[str, Any]:
    d = render_deployment(
        "llama", "serving", "uid-1", spec, flags, agent_image="agent:test", plan=prior_plan(spec)
    )
    [c] = [c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    assert isinstance(c, dict)
    return c


def as_the_kubelet_runs(command: list[str], env: dict[str, str]) -> list[str]:
    return [expand(word, env) for word in command]


FLAGS = ServingFlags(kv_cache_memory_bytes=38 * GiB)


def test_a_reference_in_extra_args_reaches_vllm_as_written_and_as_status_says() -> None:
    spec = spec_of(engine={"maxModelLen": 8192, "extraArgs": EXTRA})
    command = vllm_container(spec, FLAGS)["command"]
    ran = as_the_kubelet_runs(command, TEMPLATE_ENV)
    engine = ran[ran.index("--") + 2 :]
    # what the engine gets is what status records, byte for byte, `$(X)` literal
    status = last_known_good_status(FLAGS, spec, prior_plan(spec))
    assert status is not None and engine == status["flags"]
    assert engine[-3:] == EXTRA and SMALL_KV not in engine
    assert engine[engine.index("--kv-cache-memory-bytes") + 1] == str(38 * GiB)
    # the pod spec holds the escape; served_argv reads it back as the process receives it
    assert "$$(X)" in command
    assert served_argv({"containers": [{"name": "vllm", "command": command}]}) == engine


def test_a_dollar_anywhere_in_the_spec_is_escaped_in_command_and_env() -> None:
    spec = spec_of(
        model={
            "name": "acme/$(HOME)-7b",
            "shape": {
                "vocabSize": 32000,
                "hiddenSize": 4096,
                "numLayers": 32,
                "numHeads": 32,
                "numKVHeads": 8,
                "intermediateSize": 11008,
            },
        },
        engine={"maxModelLen": 8192, "extraArgs": ["--served-model-name", "a$$b", "$HOME", "$("]},
        modelCache={"claimName": "weights", "mountPath": "/models/$(HOME)"},
    )
    c = vllm_container(spec, FLAGS)
    ran = as_the_kubelet_runs(c["command"], TEMPLATE_ENV)
    assert ran[ran.index("serve") + 1] == "acme/$(HOME)-7b"
    assert ran[-4:] == ["--served-model-name", "a$$b", "$HOME", "$("]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert expand(env["HF_HOME"], TEMPLATE_ENV) == "/models/$(HOME)"


def test_a_spec_without_a_dollar_renders_as_before() -> None:
    spec = spec_of(engine={"maxModelLen": 8192, "extraArgs": ["--seed", "1"]})
    c = vllm_container(spec, FLAGS)
    assert c["command"][c["command"].index("--") + 2 :] == vllm_args(spec, FLAGS, prior_plan(spec))


def test_a_group_pods_own_references_are_still_expanded() -> None:
    spec = spec_of(engine={"maxModelLen": 8192, "extraArgs": ["--served-model-name", "$(X)"]})
    worker = GroupNode(
        nnodes=2,
        role="worker",
        master_addr="$(LWS_LEADER_ADDRESS)",
        master_port=29500,
        node_rank_label="leaderworkerset.sigs.k8s.io/worker-index",
    )
    pod = pod_spec(
        "llama",
        spec,
        FLAGS,
        "agent:test",
        None,
        startup_free_bytes=None,
        external_weight_bytes=None,
        shape=None,
        node=worker,
    )
    [c] = pod["containers"]
    env = {**TEMPLATE_ENV, "RANKGUARD_NODE_RANK": "1", "LWS_LEADER_ADDRESS": "leader.ns"}
    ran = as_the_kubelet_runs(c["command"], env)
    assert ran[ran.index("--node-rank") + 1] == "1"
    assert ran[ran.index("--master-addr") + 1] == "leader.ns"
    assert ran[-2:] == ["--served-model-name", "$(X)"]
    assert all(type(word) is str for word in c["command"])  # YAML's safe dumper takes no subclass


# words of `$`, parentheses and the names of TEMPLATE_ENV, so references and escapes are common
TEXT = st.lists(st.sampled_from(["$", "(", ")", "X", "HOME", "a", " ", "\U0001f999"]), max_size=24).map(
    "".join
)


@given(TEXT)
def test_the_escape_round_trips_through_the_kubelet(text: str) -> None:
    assert expand(kube_text(text), TEMPLATE_ENV) == text
    assert kube_expand(kube_text(text)) == text
    assert kube_argv([text]) == [kube_text(text)]


@given(TEXT)
def test_kube_expand_reads_a_word_as_the_kubelet_does(text: str) -> None:
    assert kube_expand(text, TEMPLATE_ENV) == expand(text, TEMPLATE_ENV)


# --- mount paths -------------------------------------------------------------------------------


def mounts(container: str, *paths: str, init: bool = False) -> dict[str, Any]:
    c: dict[str, Any] = {"name": container, "volumeMounts": [{"name": "data", "mountPath": p} for p in paths]}
    if container != "vllm":
        c["image"] = "busybox"
    return {
        "spec": {
            "volumes": [{"name": "data", "emptyDir": {}}],
            "initContainers" if init else "containers": [c],
        }
    }


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("dev double slash shm", {"template": mounts("vllm", "/dev//shm")}, "'/dev//shm' is rankguard's"),
    (
        "agent dot",
        {"template": mounts("vllm", "/opt/rankguard/./agent")},
        "'/opt/rankguard/./agent' is rankguard's",
    ),
    ("under the agent", {"template": mounts("vllm", "/opt/rankguard/agent/x")}, "is rankguard's"),
    ("relative agent", {"template": mounts("vllm", "opt/rankguard/agent")}, "is rankguard's"),
    (
        "dev",
        {"template": mounts("vllm", "/dev")},
        "containers[vllm].volumeMounts[0].mountPath '/dev' is at or under /dev",
    ),
    (
        "proc in a sidecar",
        {"template": mounts("proxy", "/proc/1")},
        "containers[proxy].volumeMounts[0].mountPath",
    ),
    ("sys in an init container", {"template": mounts("prep", "/sys/", init=True)}, "initContainers[prep]"),
    ("leading double slash", {"template": mounts("proxy", "//sys/fs")}, "is at or under /sys"),
    ("dot dot", {"template": mounts("proxy", "/a/../b")}, "has a '..' component"),
    (
        "cache by another spelling",
        {"modelCache": {"claimName": "w"}, "template": mounts("vllm", "/root//.cache/huggingface/.")},
        "is rankguard's",
    ),
    (
        "cache at /dev",
        {"modelCache": {"claimName": "w", "mountPath": "/dev"}},
        "spec.modelCache.mountPath '/dev'",
    ),
    ("cache under /proc", {"modelCache": {"claimName": "w", "mountPath": "/proc/x"}}, "is at or under /proc"),
    ("cache dot dot", {"modelCache": {"claimName": "w", "mountPath": "/m/../n"}}, "has a '..' component"),
    (
        "cache at the agent",
        {"modelCache": {"claimName": "w", "mountPath": "/opt/rankguard/./agent"}},
        "other than /",
    ),
    (
        "margin past the bound",
        {"memory": {"safetyMarginBytes": 2**62}},
        "spec.memory.safetyMarginBytes must be",
    ),
    (
        "ceiling past the bound",
        {"remediation": {"maxKVCacheBytes": 2**41}},
        "spec.remediation.maxKVCacheBytes",
    ),
]


@pytest.mark.parametrize(("case", "changes", "named"), REFUSED, ids=[c[0] for c in REFUSED])
def test_mount_paths_and_byte_bounds_are_refused_naming_the_field(
    case: str, changes: dict[str, Any], named: str
) -> None:
    with pytest.raises(SpecError) as exc:
        spec_of(**changes)
    assert named in str(exc.value), (case, str(exc.value))


def test_ordinary_mounts_pass_and_the_cache_path_is_normalised() -> None:
    spec = spec_of(
        modelCache={"claimName": "w", "mountPath": "/models//cache/./"},
        template=mounts("vllm", "/data", "/developer", "/models/cache/hub", "/system"),
    )
    assert spec.model_cache is not None and spec.model_cache.mount_path == "/models/cache"


# --- a safety margin the GPU cannot leave -----------------------------------------------------

GFD = {"nvidia.com/gpu.memory": str(80 * 1024), "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


@pytest.mark.parametrize(
    ("memory", "remediation", "said"),
    [
        ({"safetyMarginBytes": 96 * GiB}, {}, "spec.memory.safetyMarginBytes (96Gi, "),
        (
            {"safetyMarginBytes": 70 * GiB},
            {"minKVCacheBytes": 12 * GiB},
            "smallest KV budget rankguard runs (12Gi",
        ),
    ],
)
def test_a_margin_that_leaves_no_room_is_refused_before_deploying(
    memory: dict[str, Any], remediation: dict[str, Any], said: str
) -> None:
    c = Cluster()
    c.spec["memory"] = memory
    c.spec["remediation"] = remediation
    c.run(node_labels={"gpu-node-1": GFD})
    assert c.deployment is None and c.status["phase"] == "Failed"
    message = next(x for x in c.status["conditions"] if x["type"] == "Degraded")["message"]
    assert said in message and "80Gi, from the GPU Feature Discovery labels of node gpu-node-1" in message


def test_a_margin_is_held_against_the_size_the_agents_measured() -> None:
    c = Cluster()
    c.spec["memory"] = {"safetyMarginBytes": 200 * GiB}
    c.status = {"gpuMemoryBytes": 80 * GiB}
    c.run()
    assert c.deployment is None and c.status["phase"] == "Failed"
    message = next(x for x in c.status["conditions"] if x["type"] == "Degraded")["message"]
    assert "spec.memory.safetyMarginBytes (200Gi" in message and "from the agents' measurement" in message


def test_a_margin_that_leaves_room_deploys() -> None:
    c = Cluster()
    c.spec["memory"] = {"safetyMarginBytes": 8 * GiB}
    c.run(node_labels={"gpu-node-1": GFD})
    assert c.deployment is not None
