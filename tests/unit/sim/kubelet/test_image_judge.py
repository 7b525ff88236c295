"""The sandbox image's `vllm` judged by the pod's judge (agent/rankguard_agent/engine_judge.py)
exactly as a real vLLM image's is: the interpreter in its console script's `#!` line imports the
stand-in `vllm` package, whose parser and config checks are the fake's, as the release it plays."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rankguard_sim.kubelet.image import build_image
from rankguard_sim.physics.scenario_file import SCENARIO_ENV
from rankguard_sim.vllm_snapshot import ENGINE_VERSION_ENV, config_checks, playing
from tests import REPO

JUDGE = REPO / "agent" / "rankguard_agent" / "engine_judge.py"
MODEL = "meta-llama/Meta-Llama-3-8B-Instruct"
POOLING = ["--runner", "pooling", "--convert", "none"]


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return build_image(tmp_path_factory.mktemp("image") / "bin").commands


def _env(tmp: Path, image: dict[str, str], release: str | None = None) -> dict[str, str]:
    env = {
        "PATH": f"{Path(image['vllm']).parent}:/usr/bin:/bin",
        "HOME": str(tmp),
        SCENARIO_ENV: "llama3-8b-tp2-24gb",
    }
    return env if release is None else {**env, ENGINE_VERSION_ENV: release}


def _judge(
    tmp: Path, image: dict[str, str], flags: list[str], release: str | None = None
) -> dict[str, object]:
    # the judge's interpreter is the one in the `vllm` command's `#!` line, as the launcher reads it
    python = Path(image["vllm"]).read_text().splitlines()[0].removeprefix("#!").strip()
    assert python == image["python3"]
    result = tmp / "verdict.json"
    subprocess.run(
        [python, str(JUDGE), str(result), "serve", MODEL, "-tp", "2", *flags],
        env=_env(tmp, image, release),
        capture_output=True,
        timeout=120,
        check=True,
    )
    verdict: dict[str, object] = json.loads(result.read_text())
    return verdict


def _recorded(release: str) -> str:
    with playing(release):
        return str(config_checks()["model_runner"]["architectures"]["LlamaForCausalLM"]["pooling/none"])


@pytest.mark.parametrize("release", ["0.33.0", "0.34.0"])
def test_the_fake_judges_a_model_dependent_refusal_with_the_releases_words(
    tmp_path: Path, image: dict[str, str], release: str
) -> None:
    refused = _judge(tmp_path, image, POOLING, release)
    assert refused["verdict"] == "refused"
    assert refused["message"] == f"ValueError: {_recorded(release)}"
    assert refused["vllm_version"] == release
    accepted = _judge(tmp_path, image, ["--runner", "pooling"], release)
    assert accepted["verdict"] == "accepted", accepted


def test_the_parser_refuses_and_the_sandbox_limits_are_not_refusals(
    tmp_path: Path, image: dict[str, str]
) -> None:
    bogus = _judge(tmp_path, image, ["--no-such-flag"])
    assert bogus["verdict"] == "refused"
    assert "error: unrecognized arguments: --no-such-flag" in str(bogus["message"])
    # a layout vLLM takes that the sandbox does not simulate: the engine judges for itself
    limit = _judge(tmp_path, image, ["--nnodes", "2", "--distributed-executor-backend", "uni"])
    assert limit["verdict"] == "unjudged"


def test_the_engine_itself_refuses_the_same_at_start_up(tmp_path: Path, image: dict[str, str]) -> None:
    """The console script runs the fake engine (no judge): its start-up's config build refuses too."""
    out = subprocess.run(
        [image["vllm"], "serve", MODEL, "-tp", "2", *POOLING],
        env=_env(tmp_path, image),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == f"ValueError: {_recorded('0.33.0')}"
