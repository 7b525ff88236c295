"""The three causes of issue 51, held at apply time (core/engine/surface.py, vllm_cli.json_object).

Each case here is one the real vLLM refuses or cannot serve (tests/fixtures/vllm_argv_cases*.json
record what 0.33.0 and 0.34.0 did with it: the `explicit` and `config` groups); the table test
holds the lot, these name the refusal a person reads.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from rankguard_operator.core.engine.rules import rules_for
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec

V33 = "vllm/vllm-openai:v0.33.0"
V34 = "vllm/vllm-openai:v0.34.0"


def doc(extra: list[str], image: str = V33, memory: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "org/model"},
        "image": image,
        "tensorParallelSize": 2,
        "engine": {"extraArgs": extra},
    }
    if memory is not None:
        spec["resources"] = {"limits": {"memory": memory}}
    return spec


def refusal(extra: list[str], image: str = V33, memory: str | None = None) -> str | None:
    try:
        parse_spec(doc(extra, image, memory))
    except SpecError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--uds", "0"], "[0] --uds is refused: listens on a unix socket"),
        (["--ssl-keyfile", "none", "--ssl-certfile", "none"], "[0] --ssl-keyfile is refused: TLS"),
        (["--data-parallel-size-local=0"], "[0] --data-parallel-size-local is refused: one pod"),
        (["--nnodes", "0"], "[0] --nnodes is refused"),
        (["--node-rank=-1"], "[0] --node-rank is refused"),
        (["-pcp", "0"], "leaves vLLM a world of no GPUs"),
        (["--numa-bind-nodes", "0"], "needs --numa-bind"),
    ],
)
def test_explicit_off_looking_values_are_values_to_vllm(extra: list[str], needle: str) -> None:
    why = refusal(extra)
    assert why is not None and needle in why, why


@pytest.mark.parametrize(
    "extra",
    [
        ["--nnodes", "1"],  # vLLM's default: one node
        ["--node-rank", "0"],
        ["--cpu-offload-gb", "0"],  # the default: nothing offloaded
        ["--uds", "None"],  # vLLM's optional type reads None as unset
        ["-pcp", "1"],
    ],
)
def test_a_value_vllm_reads_as_its_default_changes_nothing(extra: list[str]) -> None:
    assert refusal(extra) is None


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            [
                "--compilation-config",
                '{"max_cudagraph_capture_size": 8, "cudagraph_capture_sizes": [1, 2, 4]}',
            ],
            "max_cudagraph_capture_size (8) must be the largest of the capture sizes (4)",
        ),
        (
            [
                "--compilation-config",
                '{"max_cudagraph_capture_size": 8}',
                "--cudagraph-capture-sizes",
                "1",
                "2",
            ],
            "must be the largest of the capture sizes (2)",
        ),
        (["-cc.max_cudagraph_capture_size=8", "-cc.cudagraph_capture_sizes+", "1,2,4"], "largest"),
        (
            ["--compilation-config", '{"cudagraph_capture_sizes": [1, 2]}', "--cudagraph-capture-sizes", "1"],
            "mutually exclusive",
        ),
        (["--compilation-config", '{"cudagraph_capture_sizes": []}'], "cudagraph_capture_sizes is empty"),
        (["--speculative-config", '{"num_speculative_tokens": 3}'], "needs a draft model or a method"),
        (["--speculative-config", '{"method": "ngram"}'], "needs num_speculative_tokens"),
        (["--speculative-config.method", "ngram"], "needs num_speculative_tokens"),
        (
            ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "must be greater than 0",
        ),
        (["--kv-transfer-config", '{"kv_role": "kv_both"}'], "names no kv_connector"),
        (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1"}'], "needs kv_role"),
        (["--hf-overrides", "0"], "--hf-overrides needs a JSON object"),
        (["--optimization-level", "x"], "takes 0, 1, 2 or 3"),
        (["--lora-modules", "none"], "takes name=path or a JSON object"),
        (["--enable-fault-tolerance"], "external data-parallel load balancing"),
        (["--collect-detailed-traces", "all"], "needs --otlp-traces-endpoint"),
        (["--mamba-ssu-algorithm", "auto"], "needs --mamba-backend flashinfer"),
    ],
)
def test_json_options_go_through_the_checks_vllm_makes_when_it_builds_the_config(
    extra: list[str], needle: str
) -> None:
    why = refusal(extra)
    assert why is not None and needle in why and why.startswith("spec.engine.extraArgs["), why


def test_a_kv_connector_the_release_does_not_have_is_refused_where_the_snapshot_lists_them() -> None:
    extra = ["--kv-transfer-config", '{"kv_connector": "NoSuchConnector", "kv_role": "kv_both"}']
    why = refusal(extra, V34)
    assert why is not None and "vLLM 0.34.0 has no KV connector NoSuchConnector" in why, why
    assert (
        refusal(["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'], V34)
        is None
    )
    module = {"kv_connector": "Mine", "kv_role": "kv_both", "kv_connector_module_path": "my.connectors"}
    assert refusal(["--kv-transfer-config", json.dumps(module)], V34) is None


@pytest.mark.parametrize("image", [V33, V34])
def test_host_memory_is_counted_in_every_spelling(image: str) -> None:
    tib = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    tib["kv_connector_extra_config"] = {"cpu_bytes_to_use": 1 << 40}  # type: ignore[assignment]
    for extra in (["--kv-offloading-size", "1024"], ["--kv-transfer-config", json.dumps(tib)]):
        why = refusal(extra, image, memory="64Gi")
        assert why is not None and "1Ti of host memory" in why and "spec.resources.limits.memory" in why, why
        assert refusal(extra, image, memory="2Ti") is None
    dotted = [
        "--kv-transfer-config.kv_connector",
        "OffloadingConnector",
        "--kv-transfer-config.kv_role",
        "kv_both",
    ]
    dotted += ["--kv-transfer-config.kv_connector_extra_config.cpu_bytes_to_use", "80g"]  # vLLM: 80e9 bytes
    why = refusal(dotted, image, memory="64Gi")
    assert why is not None and "74.5Gi of host memory" in why, why


def test_the_json_option_reader_folds_as_vllm_folds() -> None:
    cli = rules_for("0.33.0").cli
    assert cli.json_object([], "compilation_config") is None
    assert cli.json_object(["-cc", '{"mode": 3}', "-cc", '{"mode": 2}'], "compilation_config") == {"mode": 2}
    # dotted items are appended after the rest by FlexibleArgumentParser: they win over a whole value
    got = cli.json_object(["-cc.mode=3", "--compilation-config", '{"mode": 1}'], "compilation_config")
    assert got == {"mode": 3}
    got = cli.json_object(["--compilation-config.cudagraph_capture_sizes+", "1,2"], "compilation_config")
    assert got == {"cudagraph_capture_sizes": ["1", "2"]}
    assert cli.json_object(["-cc", '{"max_cudagraph_capture_size": 4k}'], "compilation_config") == {
        "max_cudagraph_capture_size": 4000
    }
    assert cli.json_object(["-cc", "{not json"], "compilation_config") is None
