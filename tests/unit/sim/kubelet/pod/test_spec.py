"""The process kubelet's pod-spec rules: `$(VAR)` expansion, env, paths, commands, quantities,
back-off, pod IPs and the files a pod's volumes hold.

They are plain functions of the pod as the API serves it, so each rule is checked here on
plain data, without a cluster or a process; volumes share the pod and its facts with env.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rankguard_sim.kubelet.pod.spec import (
    ImageTable,
    IpPool,
    PathMap,
    PodFacts,
    SpecError,
    backoff_delay,
    container_argv,
    container_env,
    expand,
    image_repository,
    memory_limit_bytes,
    pod_gpu_count,
    quantity_bytes,
    resolve_executable,
)
from rankguard_sim.kubelet.pod.volumes import volume_files

FACTS = PodFacts(
    pod_ip="127.0.0.7", host_ip="127.0.0.1", node_name="gpu-1", node_allocatable={"memory": "8Gi"}
)
POD: dict[str, Any] = {
    "metadata": {"name": "web-0", "namespace": "ns1", "uid": "u-1", "labels": {"app": "x"}},
    "spec": {"serviceAccountName": "sa"},
}


# ------------------------------------------------------------------------------ expansion


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$(A)", "alpha"),
        ("x-$(A)-$(B)", "x-alpha-beta"),
        ("$$(A)", "$(A)"),  # escaped: not a reference
        ("$$$(A)", "$alpha"),
        ("$(MISSING)", "$(MISSING)"),  # unknown names stay as written
        ("$(A", "$(A"),  # unclosed
        ("cost $5", "cost $5"),
        ("trailing $", "trailing $"),
        ("$()", "$()"),
        ("", ""),
    ],
)
def test_expand_follows_the_kubelet_rules(text: str, expected: str) -> None:
    assert expand(text, {"A": "alpha", "B": "beta"}) == expected


@given(st.text(alphabet="ab$()XY", max_size=30))
def test_escaping_every_dollar_makes_expansion_the_identity(text: str) -> None:
    assert expand(text.replace("$", "$$"), {"X": "1", "Y": "2"}) == text


# ------------------------------------------------------------------------------ env


def test_env_values_expand_against_earlier_variables_only() -> None:
    container = {
        "env": [
            {"name": "LATER_REF", "value": "$(B)"},
            {"name": "B", "value": "b"},
            {"name": "C", "value": "$(B)/$(POD_IP)"},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "D", "value": "$(POD_IP)"},
        ]
    }
    env = container_env(POD, container, FACTS)
    assert env == {"LATER_REF": "$(B)", "B": "b", "C": "b/$(POD_IP)", "POD_IP": "127.0.0.7", "D": "127.0.0.7"}


def test_downward_api_field_refs() -> None:
    paths = [
        "metadata.name",
        "metadata.namespace",
        "metadata.uid",
        "spec.nodeName",
        "status.hostIP",
        "spec.serviceAccountName",
        "metadata.labels['app']",
    ]
    container = {
        "env": [{"name": f"V{i}", "valueFrom": {"fieldRef": {"fieldPath": p}}} for i, p in enumerate(paths)]
    }
    env = container_env(POD, container, FACTS)
    assert list(env.values()) == ["web-0", "ns1", "u-1", "gpu-1", "127.0.0.1", "sa", "x"]
    with pytest.raises(SpecError, match="unsupported fieldRef"):
        container_env(
            POD, {"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.nope"}}}]}, FACTS
        )


def test_resource_field_refs_round_up_by_divisor_and_default_to_node_allocatable() -> None:
    container = {
        "resources": {"limits": {"memory": "1Gi", "cpu": "1500m"}},
        "env": [
            {
                "name": "MEM_MI",
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}},
            },
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "REQ_MEM", "valueFrom": {"resourceFieldRef": {"resource": "requests.memory"}}},
        ],
    }
    env = container_env(POD, container, FACTS)
    assert env == {"MEM_MI": "1024", "CPU": "2", "REQ_MEM": str(1 << 30)}
    unlimited = {"env": [{"name": "M", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory"}}}]}
    assert container_env(POD, unlimited, FACTS)["M"] == str(8 << 30)


def test_config_map_and_secret_refs_use_the_lookups_and_honour_optional() -> None:
    objects = {("configmap", "ns1", "cm"): {"k": "from-cm"}, ("secret", "ns1", "s"): {"token": "t0p"}}

    def obj(kind: str, ns: str, name: str) -> dict[str, str] | None:
        return objects.get((kind, ns, name))

    def key(kind: str, ns: str, name: str, k: str) -> str | None:
        data = obj(kind, ns, name)
        return None if data is None else data.get(k)

    container = {
        "envFrom": [
            {"configMapRef": {"name": "cm"}, "prefix": "CM_"},
            {"secretRef": {"name": "gone", "optional": True}},
        ],
        "env": [
            {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}},
            {
                "name": "OPT",
                "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "nope", "optional": True}},
            },
        ],
    }
    assert container_env(POD, container, FACTS, key, obj) == {"CM_k": "from-cm", "TOKEN": "t0p"}
    missing = {"env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "nope"}}}]}
    with pytest.raises(SpecError) as err:
        container_env(POD, missing, FACTS, key, obj)
    assert err.value.reason == "CreateContainerConfigError"


# ------------------------------------------------------------------------------ paths


def test_path_map_rewrites_whole_segments_longest_mount_first() -> None:
    pm = PathMap.build(
        [
            ("/opt/rankguard", "/tmp/p/vol-a"),
            ("/opt/rankguard/agent", "/tmp/p/vol-b"),
            ("/data/", "/tmp/p/d"),
        ],
        [("/dev/termination-log", "/tmp/p/c/termination-log")],
    )
    assert pm.path("/opt/rankguard") == "/tmp/p/vol-a"
    assert pm.path("/opt/rankguard/x.py") == "/tmp/p/vol-a/x.py"
    assert pm.path("/opt/rankguard/agent/rankguard_agent") == "/tmp/p/vol-b/rankguard_agent"
    assert pm.path("/opt/rankguardian") == "/opt/rankguardian"  # not a path segment match
    assert pm.path("/data/f") == "/tmp/p/d/f"
    assert pm.path("/dev/termination-log") == "/tmp/p/c/termination-log"
    assert pm.path("/dev/termination-log2") == "/dev/termination-log2"
    assert pm.arg("--termination-log=/dev/termination-log") == "--termination-log=/tmp/p/c/termination-log"
    assert pm.arg("--out=/opt/rankguard/o") == "--out=/tmp/p/vol-a/o"
    assert pm.arg("key=/opt/rankguard") == "key=/opt/rankguard"  # only flags get the `=` treatment
    assert pm.env_value("/opt/rankguard/agent:/usr/lib/py") == "/tmp/p/vol-b:/usr/lib/py"
    assert pm.env_value("http://example.invalid:80/") == "http://example.invalid:80/"


# ------------------------------------------------------------------------------ commands

TABLE = ImageTable(
    commands={"python3": "/sandbox/bin/python3", "vllm": "/sandbox/bin/vllm"},
    entrypoints={"vllm/vllm-openai": (("vllm", "serve"), ()), "python": ((), ("python3",))},
)


def test_command_args_and_image_entrypoints() -> None:
    env = {"MODEL": "m", "PORT": "8000"}
    assert container_argv({"command": ["python3", "-m", "x"], "args": ["--port", "$(PORT)"]}, TABLE, env) == [
        "python3",
        "-m",
        "x",
        "--port",
        "8000",
    ]
    # args only: the image's ENTRYPOINT + the container's args (the image's CMD is dropped)
    assert container_argv(
        {"image": "docker.io/vllm/vllm-openai:v0.9.1", "args": ["$(MODEL)"]}, TABLE, env
    ) == [
        "vllm",
        "serve",
        "m",
    ]
    assert container_argv({"image": "python:3.11"}, TABLE, env) == ["python3"]
    with pytest.raises(SpecError, match="no command specified"):
        container_argv({"image": "example.invalid/unknown:1"}, TABLE, env)


def test_unknown_commands_fail_like_a_runtime_and_name_the_table() -> None:
    assert resolve_executable("vllm", TABLE) == "/sandbox/bin/vllm"
    with pytest.raises(SpecError) as err:
        resolve_executable("nvidia-smi", TABLE)
    assert err.value.reason == "StartError"
    assert 'exec: "nvidia-smi": executable file not found in $PATH' in err.value.message
    assert "python3" in err.value.message


@pytest.mark.parametrize(
    ("image", "repo"),
    [
        ("vllm/vllm-openai:v0.9.1", "vllm/vllm-openai"),
        ("docker.io/vllm/vllm-openai@sha256:abc", "vllm/vllm-openai"),
        ("localhost:5000/team/img:1", "team/img"),
        ("docker.io/library/python:3.11", "python"),
        ("python", "python"),
    ],
)
def test_image_repository(image: str, repo: str) -> None:
    assert image_repository(image) == repo


# ------------------------------------------------------------------------------ small rules


def test_backoff_doubles_from_base_up_to_cap() -> None:
    assert [backoff_delay(n, 0.5, 3.0) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff_delay(10_000, 10, 300) == 300


def test_ip_pool_hands_out_the_lowest_free_address_and_reuses_it() -> None:
    pool = IpPool(first=2, last=4)
    assert [pool.acquire(o) for o in ("a", "b", "c")] == ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    assert pool.acquire("b") == "127.0.0.3"  # same owner, same address
    with pytest.raises(SpecError):
        pool.acquire("d")
    pool.release("b")
    assert pool.acquire("d") == "127.0.0.3"
    assert pool.in_use() == {"a": "127.0.0.2", "c": "127.0.0.4", "d": "127.0.0.3"}


def test_gpu_and_memory_quantities() -> None:
    pod = {
        "spec": {
            "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "4"}}}],
            "containers": [
                {"resources": {"limits": {"nvidia.com/gpu": "2"}}},
                {"resources": {"limits": {"nvidia.com/gpu": 1}}},
            ],
        }
    }
    assert pod_gpu_count(pod) == 4
    pod["spec"]["initContainers"] = []
    assert pod_gpu_count(pod) == 3
    assert quantity_bytes("1Gi") == 1 << 30
    assert quantity_bytes("1.5M") == 1_500_000
    assert memory_limit_bytes({"resources": {"limits": {"memory": "64Mi"}}}) == 64 << 20
    assert memory_limit_bytes({}) is None


# ------------------------------------------------------------------------------ volumes


def test_volume_files_from_config_maps_secrets_downward_api_and_tokens() -> None:
    objects = {
        ("configmap", "ns1", "kube-root-ca.crt"): {"ca.crt": "CA"},
        ("secret", "ns1", "s"): {"a": "1", "b": "2"},
    }

    def lookup(kind: str, ns: str, name: str) -> dict[str, str] | None:
        return objects.get((kind, ns, name))

    def token(pod: Any, source: Any) -> str:
        return f"token-for-{pod['metadata']['name']}-{source.get('audience', 'api')}"

    projected = {
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]
                    }
                },
            ]
        }
    }
    assert volume_files(POD, projected, FACTS, lookup, token) == {
        "token": b"token-for-web-0-api",
        "ca.crt": b"CA",
        "namespace": b"ns1",
    }
    secret = {"secret": {"secretName": "s", "items": [{"key": "b", "path": "dir/b.txt"}]}}
    assert volume_files(POD, secret, FACTS, lookup, token) == {"dir/b.txt": b"2"}
    assert volume_files(POD, {"emptyDir": {}}, FACTS, lookup, token) == {}
    assert volume_files(POD, {"configMap": {"name": "missing", "optional": True}}, FACTS, lookup, token) == {}
    with pytest.raises(SpecError) as err:
        volume_files(POD, {"configMap": {"name": "missing"}}, FACTS, lookup, token)
    assert err.value.reason == "FailedMount"
