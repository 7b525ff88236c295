"""`rankguard plan`: the table for people, JSON for scripts, one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rankguard_operator.cli import main
from rankguard_operator.core.model.resolve import resolve_model
from rankguard_operator.core.planner import PlanInput, make_plan
from rankguard_operator.core.units import GiB

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
    expected = make_plan(
        PlanInput(
            shape=resolve_model("meta-llama/Meta-Llama-3-70B"),
            gpu_memory_bytes=80 * GiB,
            tp=8,
            max_num_seqs=128,
            logits_mode="gather",
        )
    ).to_dict()
    assert doc == json.loads(json.dumps(expected))
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
    assert rc == 0 and "Flags:" in out
