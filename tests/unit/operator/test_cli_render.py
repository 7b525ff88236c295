"""`rankguard render -f`: the operator's own first pass, offline, as YAML; `--check` against vLLM's CLI."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from rankguard_operator.cli import main
from rankguard_operator.cli_render import check_deployment
from rankguard_operator.core.render.pod import vllm_args
from rankguard_operator.core.spec.parse import parse_spec
from tests import REPO
from tests.builders import llmservice
from tests.unit.reconcile_world import flags_of, vllm_argv

EXAMPLE = REPO / "examples" / "llama3-70b-tp4.yaml"
SERVICE = llmservice(
    "small",
    {
        "model": {"name": "meta-llama/Meta-Llama-3-8B-Instruct"},
        "image": "vllm/vllm-openai:v0.33.0",
        "tensorParallelSize": 2,
        "engine": {"maxModelLen": 8192, "extraArgs": ["--enable-prefix-caching"]},
    },
    namespace="serving",
)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def write(tmp_path: Path, *docs: Any) -> str:
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return str(path)


def test_the_example_renders_and_checks(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "render", "-f", str(EXAMPLE), "--check")
    assert rc == 0, err
    objs = list(yaml.safe_load_all(out))
    assert [o["kind"] for o in objs] == ["Deployment", "Service"]
    assert "&id" not in out  # no YAML anchors for kubectl and for people


def test_render_is_the_operators_first_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "render", "-f", write(tmp_path, {"kind": "ConfigMap"}, SERVICE))
    assert rc == 0, err
    deployment, service = yaml.safe_load_all(out)
    assert deployment["metadata"]["namespace"] == "serving" and service["metadata"]["name"] == "small"
    # no GPU size known: vLLM's default utilisation, as the operator starts
    spec = parse_spec(SERVICE["spec"])
    argv = vllm_argv(deployment)
    assert argv[:2] == ["serve", "meta-llama/Meta-Llama-3-8B-Instruct"]
    assert "--kv-cache-memory-bytes" not in argv
    assert argv[-1] == "--enable-prefix-caching" and "--block-size" not in argv
    assert argv[: len(vllm_args(spec, flags_of(deployment), None))] == vllm_args(
        spec, flags_of(deployment), None
    )


def test_a_known_gpu_size_renders_the_planned_byte_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(capsys, "render", "-f", write(tmp_path, SERVICE), "--gpu-memory", "24GiB", "--check")
    assert rc == 0, err
    argv = vllm_argv(next(yaml.safe_load_all(out)))
    kv = int(argv[argv.index("--kv-cache-memory-bytes") + 1])
    util = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert 0 < kv < 24 << 30 and util < 0.92


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--max-num-seqs 64"], "spec.engine.extraArgs[0] '--max-num-seqs 64' is one argv item"),
        (["--device-memory-utilization", "0.5"], "use spec.memory.gpuMemoryUtilization instead"),
        (["--config", "serve.yaml"], "--config is refused"),
    ],
)
def test_a_spec_the_operator_refuses_is_refused_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    doc = copy.deepcopy(SERVICE)
    doc["spec"]["engine"]["extraArgs"] = extra
    rc, out, err = run(capsys, "render", "-f", write(tmp_path, doc))
    assert rc == 2 and out == ""
    assert fragment in err and err.startswith("rankguard: error: serving/small: "), err


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("kind: ConfigMap\n", "holds no LLMService"),
        (
            "apiVersion: v1\nkind: LLMService\nmetadata: {name: x}\n",
            "apiVersion must be rankguard.io/v1alpha1",
        ),
        ("a: [\n", "is not valid YAML"),
    ],
)
def test_bad_files_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, fragment: str
) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(content)
    rc, _, err = run(capsys, "render", "-f", str(path))
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    rc, _, err = run(capsys, "render", "-f", str(tmp_path / "missing.yaml"))
    assert rc == 2 and "cannot read" in err


def test_check_reports_what_vllm_would_refuse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "render", "-f", write(tmp_path, SERVICE))
    assert rc == 0
    deployment = next(yaml.safe_load_all(out))
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    command += ["--max-num-seqs", "many", "--no-such-flag"]  # as a hand edit would
    problems, note = check_deployment(deployment)
    assert note is None
    assert any("--max-num-seqs needs an integer, got 'many'" in p for p in problems), problems
    assert any("has no option --no-such-flag" in p for p in problems), problems
