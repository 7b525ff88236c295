"""`rankguard plan`: the table for people, JSON for scripts, one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rankguard_operator import vllm_snapshots
from rankguard_operator.cli import main
from rankguard_operator.cli_plan import plan_doc
from rankguard_operator.core.budget.planner import PlanInput, make_plan
from rankguard_operator.core.model.resolve import resolve_model
from rankguard_operator.core.render.pod import served_argv
from rankguard_operator.core.units import GiB
from tests.builders import llmservice

ISSUE_EXAMPLE = [
    "plan",
    "--model",
    "meta-llama/Meta-Llama-3-70B",
    "--tp",
    "8",
    "--gpu-memory",
    "80GiB",
    "--max-num-seqs",
    "128",
    "--logits",
    "gather",
]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_json_output_matches_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, *ISSUE_EXAMPLE, "--json")
    assert rc == 0, err
    doc = json.loads(out)
    plan = make_plan(
        PlanInput(
            shape=resolve_model("meta-llama/Meta-Llama-3-70B"),
            gpu_memory_bytes=80 * GiB,
            tp=8,
            max_num_seqs=128,
            logits_mode="gather",
            # `rankguard plan` plans for the newest recorded release unless --vllm-version says
            block_size=vllm_snapshots.latest().default_block_size,
        )
    )
    assert doc == json.loads(json.dumps(plan_doc(plan, doc["flags"])))
    assert doc["kv_cache_memory_bytes"] == plan.kv_cache_memory_bytes
    assert len(doc["ranks"]) == 8 and all(isinstance(r["non_kv_bytes"], int) for r in doc["ranks"])
    assert doc["bottleneck_rank"] == 0
    assert doc["kv_bytes_per_token"] == 40_960
    assert doc["ranks"][0]["logits_bytes"] - doc["ranks"][1]["logits_bytes"] == 57_458_688
    for key in ("kv_cache_memory_bytes", "gpu_memory_utilization", "kv_tokens", "max_concurrency"):
        assert key in doc


def test_table_output_names_the_bottleneck_and_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, *ISSUE_EXAMPLE)
    assert rc == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("RANK"))
    for column in (
        "WEIGHTS",
        "LOGITS",
        "ACTIVATIONS",
        "CTX+NCCL",
        "CUDA-GRAPHS",
        "NON-KV",
        "SAFE-KV",
        "HEADROOM",
    ):
        assert column in header
    rows = [line for line in lines if line[:1].isdigit()]
    assert len(rows) == 8
    assert rows[0].startswith("0*")  # the bottleneck is starred
    assert not any(r.split()[0].endswith("*") for r in rows[1:])
    assert "62.6Mi" in rows[0] and "7.8Mi" in rows[1]  # full-vocab vs 1/8 logits at batch 128
    budget = json.loads(run_json(capsys))["kv_cache_memory_bytes"]
    assert f"--kv-cache-memory-bytes {budget}" in out
    assert "--tensor-parallel-size 8" in out
    assert "set by rank 0" in out


def run_json(capsys: pytest.CaptureFixture[str]) -> str:
    rc, out, _ = run(capsys, *ISSUE_EXAMPLE, "--json")
    assert rc == 0
    return out


def test_config_file_instead_of_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {
        "_name_or_path": "acme/private-34b",
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 64000,
        "hidden_size": 7168,
        "num_hidden_layers": 60,
        "num_attention_heads": 56,
        "num_key_value_heads": 8,
        "intermediate_size": 20480,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = run(capsys, "plan", "--config", str(path), "--tp", "4", "--gpu-memory", "80Gi", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["model"] == "acme/private-34b"
    assert doc["max_model_len"] == 4096
    assert doc["kv_bytes_per_token"] == 2 * 2 * 128 * 2 * 60  # 8 KV heads / TP 4 = 2 per rank


def test_config_and_model_name_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 1000,
                "hidden_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "intermediate_size": 1024,
            }
        )
    )
    rc, out, _ = run(
        capsys,
        "plan",
        "--model",
        "acme/tiny",
        "--config",
        str(path),
        "--gpu-memory",
        "16Gi",
        "--max-model-len",
        "2048",
        "--json",
    )
    assert rc == 0
    assert json.loads(out)["model"] == "acme/tiny"


def test_shape_flags_make_an_unknown_model_plannable(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(
        capsys,
        "plan",
        "--model",
        "acme/x",
        "--gpu-memory",
        "80GiB",
        "--max-model-len",
        "4096",
        "--json",
        "--shape",
        "vocabSize=32000",
        "--shape",
        "hiddenSize=4096",
        "--shape",
        "numLayers=32",
        "--shape",
        "numHeads=32",
        "--shape",
        "numKVHeads=8",
        "--shape",
        "intermediateSize=11008",
        "--shape",
        "tieWordEmbeddings=true",
    )
    assert rc == 0, err
    assert json.loads(out)["kv_bytes_per_token"] == 131_072


def test_unknown_model_is_a_one_line_error_naming_what_to_provide(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "plan", "--model", "acme/unheard-of", "--gpu-memory", "80GiB")
    assert rc == 2
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("rankguard: error: unknown model 'acme/unheard-of'")
    assert "--config path/to/config.json" in err
    assert "spec.model.shape" in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "--gpu-memory", "80GiB"], "give --model NAME or --config"),
        (
            ["plan", "--model", "meta-llama/Meta-Llama-3-70B", "--gpu-memory", "80GiB", "--tp", "3"],
            "does not divide",
        ),
        (["plan", "--config", "/nonexistent/config.json", "--gpu-memory", "80GiB"], "cannot read --config"),
        (
            [
                "plan",
                "--model",
                "meta-llama/Meta-Llama-3-70B",
                "--gpu-memory",
                "80GiB",
                "--shape",
                "numLayers=0",
            ],
            "num_layers must be a positive integer",
        ),
    ],
)
def test_input_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    rc, out, err = run(capsys, *argv)
    assert rc == 2
    assert out == ""
    assert fragment in err
    assert err.count("\n") == 1


def test_bad_json_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    rc, _, err = run(capsys, "plan", "--config", str(path), "--gpu-memory", "80GiB")
    assert rc == 2
    assert "not valid JSON" in err


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "--model", "x", "--gpu-memory", "80Gx"], "unknown unit"),
        (["plan", "--model", "x"], "--gpu-memory"),
        (["plan", "--model", "x", "--gpu-memory", "80GiB", "--logits", "scatter"], "invalid choice"),
        (["plan", "--model", "x", "--gpu-memory", "80GiB", "--measured-free", "zero=1Gi"], "RANK=BYTES"),
        (["plan", "--model", "x", "--gpu-memory", "80GiB", "--shape", "layers=3"], "KEY=VALUE"),
        ([], "COMMAND"),
    ],
)
def test_argument_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert fragment in err


def test_measured_free_memory_moves_the_bottleneck(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, *ISSUE_EXAMPLE, "--measured-free", "3=60GiB", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["bottleneck_rank"] == 3
    assert doc["ranks"][3]["context_source"] == "measured"
    assert doc["ranks"][3]["context_bytes"] == 20 * GiB


def test_infeasible_plan_exits_1_and_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(
        capsys, "plan", "--model", "meta-llama/Meta-Llama-3-70B", "--tp", "2", "--gpu-memory", "24GiB"
    )
    assert rc == 1
    assert "warning:" in out
    assert "cannot hold one request" in out


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "plan", "--help")
    assert rc == 0
    assert "--kv-cache-dtype" in out and "--logits" in out


def test_an_unmodelled_architecture_is_refused_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = {
        "architectures": ["RwkvForCausalLM"],
        "model_type": "rwkv",
        "vocab_size": 65536,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "intermediate_size": 14336,
        "max_position_embeddings": 4096,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, _, err = run(capsys, "plan", "--config", str(path), "--gpu-memory", "80Gi")
    assert rc == 3
    assert "RwkvForCausalLM (rwkv) is not modelled" in err and "--allow-unmodelled" in err
    rc, out, _ = run(capsys, "plan", "--config", str(path), "--gpu-memory", "80Gi", "--allow-unmodelled")
    assert rc == 0 and "Flags (the vLLM command line the operator deploys):" in out


# `rankguard plan` and `rankguard render`: one renderer, so the same spec gives the same vLLM flags.
PLAN_VS_RENDER: list[tuple[str, dict[str, object], list[str]]] = [
    (
        "70b tp4 defaults",
        {"model": {"name": "meta-llama/Meta-Llama-3-70B-Instruct"}, "tensorParallelSize": 4},
        ["--model", "meta-llama/Meta-Llama-3-70B-Instruct", "--tp", "4"],
    ),
    (
        "8b tp2 pp2, fp8 KV, eager, gather, a block size",
        {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
            "tensorParallelSize": 2,
            "pipelineParallelSize": 2,
            "engine": {
                "maxNumSeqs": 64,
                "maxNumBatchedTokens": 4096,
                "maxModelLen": 8192,
                "kvCacheDtype": "fp8",
                "blockSize": 32,
                "enforceEager": True,
                "logitsMode": "gather",
            },
            "memory": {"safetyMarginBytes": 1 << 30},
        },
        [
            "--model", "meta-llama/Meta-Llama-3-8B-Instruct", "--tp", "2", "--pp", "2",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--max-model-len", "8192",
            "--kv-cache-dtype", "fp8", "--block-size", "32", "--enforce-eager", "--logits", "gather",
            "--safety-margin", "1GiB",
        ],
    ),
    (
        "runtime fp8 weights, bfloat16",
        {
            "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct", "quantization": "fp8"},
            "engine": {"dtype": "bfloat16", "maxModelLen": 4096},
        },
        [
            "--model", "meta-llama/Meta-Llama-3-8B-Instruct", "--quantization", "fp8",
            "--dtype", "bfloat16", "--max-model-len", "4096",
        ],
    ),
]  # fmt: skip


RELEASE = "0.33.0"


@pytest.mark.parametrize(("case", "spec", "plan_args"), PLAN_VS_RENDER, ids=[c[0] for c in PLAN_VS_RENDER])
def test_plan_prints_the_flags_render_deploys_for_the_same_spec(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    case: str,
    spec: dict[str, object],
    plan_args: list[str],
) -> None:
    doc = llmservice("svc", {**spec, "image": f"vllm/vllm-openai:v{RELEASE}", "memory": {
        **dict(spec.get("memory") or {}),  # type: ignore[call-overload]
        "gpuMemoryBytes": 80 * GiB,
    }})  # fmt: skip
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(doc))
    rc, out, err = run(capsys, "render", "-f", str(path))
    assert rc == 0, err
    [deployment] = [d for d in yaml.safe_load_all(out) if d["kind"] == "Deployment"]
    rendered = served_argv(deployment["spec"]["template"]["spec"])
    # the same release as the image's: its block size sets the budget's rounding
    plan_args = [*plan_args, "--vllm-version", RELEASE]
    rc, out, err = run(capsys, "plan", *plan_args, "--gpu-memory", "80GiB", "--json")
    assert rc == 0, err
    planned = json.loads(out)["flags"]
    assert planned == rendered
    assert "--kv-cache-memory-bytes" in planned and "--gpu-memory-utilization" in planned
    # and the table prints the same command line
    rc, out, _ = run(capsys, "plan", *plan_args, "--gpu-memory", "80GiB")
    assert "vllm " + " ".join(rendered) in out


def test_plan_refuses_a_value_the_operator_would_refuse(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, *ISSUE_EXAMPLE, "--block-size", "24")
    assert rc == 2 and "spec.engine.blockSize must be one of" in err


@pytest.mark.parametrize(
    ("version", "block"),
    [
        ("0.33.0", 16),
        ("0.34.0", 64),
        ("v0.35.1", 64),  # unrecorded: the nearest older release's, as the operator picks it
        (None, vllm_snapshots.latest().default_block_size),  # the newest recorded by default
    ],
)
def test_the_block_size_and_floor_are_the_vllm_versions(
    capsys: pytest.CaptureFixture[str], version: str | None, block: int
) -> None:
    """vLLM 0.34 defaults to 64-token blocks where 0.33 used 16: the plan's blocks, tokens and
    floor (one request of 8,192 tokens plus the null block) count the release's own."""
    argv = [
        "plan",
        "--model",
        "meta-llama/Meta-Llama-3-8B",
        "--gpu-memory",
        "80GiB",
        "--max-model-len",
        "8192",
    ]
    rc, out, err = run(capsys, *argv, *(["--vllm-version", version] if version else []), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["block_size"] == block
    assert doc["min_kv_cache_memory_bytes"] == (8192 // block + 1) * block * 131_072
    rc, out, _ = run(capsys, *argv, *(["--vllm-version", version] if version else []))
    assert f"blocks of {block} = " in out


def test_a_vllm_version_that_is_not_one_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, *ISSUE_EXAMPLE, "--vllm-version", "nightly")
    assert rc == 2 and "'nightly' is not a vLLM version" in err
