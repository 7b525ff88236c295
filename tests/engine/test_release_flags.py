"""A flag the engine's release lacks: the real engine cannot run the command, and rankguard refuses
it for that release before anything is deployed.

The flag is found in the recorded snapshots (an option the newest recorded release has, and
rankguard accepts for it, that the engine's own release does not), never named here. Rendered for
an image of the newest release, the command carries it; the
real engine of the older release exits at once, naming it. For an image of the engine's release,
`rankguard render --check` refuses the same LLMService, naming the flag and the release.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.names import VLLM_CONTAINER
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_sim.vllm_snapshot import switches_only_in
from tests.builders import llmservice

from .conftest import Engine

NEWEST = vllm_snapshots.latest().version


def _service(image: str, model: Path, flag: str) -> dict[str, Any]:
    return llmservice(
        "tiny",
        {
            "model": {"name": str(model)},
            "image": image,
            "tensorParallelSize": 1,
            "engine": {"maxModelLen": 512, "maxNumSeqs": 8, "enforceEager": True, "extraArgs": [flag]},
            "memory": {"kvCacheMemoryBytes": 64 << 20},
        },
        namespace="serving",
    )


def _accepted(model: Path, flag: str) -> bool:
    """rankguard's own verdict on `flag` for an image of the newest release."""
    try:
        parse_spec(_service(f"vllm/vllm-openai:v{NEWEST}", model, flag)["spec"])
    except SpecError:
        return False
    return True


def _render(tmp_path: Path, doc: dict[str, Any], *check: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(doc))
    return subprocess.run(
        [sys.executable, "-m", "rankguard_operator.cli", "render", "-f", str(path), *check],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def _served_argv(rendered: str) -> list[str]:
    """The `vllm serve …` command the agent's launcher runs (after its `--`)."""
    for doc in yaml.safe_load_all(rendered):
        if doc and doc.get("kind") == "Deployment":
            (c,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == VLLM_CONTAINER]
            command = [*c.get("command", []), *c.get("args", [])]
            return command[command.index("--") + 1 :]
    raise AssertionError(f"no Deployment rendered:\n{rendered[:2000]}")


def test_a_flag_the_release_lacks_stops_the_real_engine_and_rankguard_refuses_it(
    engine: Engine, tmp_path: Path
) -> None:
    release = vllm_snapshots.for_engine(engine.version).snapshot.version
    assert release != NEWEST, "the engine tier's release is the newest recorded one: no newer flag to try"
    # one rankguard accepts for the newest release (some are refused for what they do, not for
    # the release: e.g. a checkpoint-on-start switch whose engine never serves)
    flags = [f for f in switches_only_in(NEWEST, release) if _accepted(engine.model, f)]
    assert flags, f"no value-less option of vLLM {NEWEST} that {release} lacks and rankguard accepts"
    flag = flags[0]
    base = "{}.{}.{}".format(*(vllm_snapshots.version_key(engine.version) or (0, 0, 0)))

    # rendered for an image that has the flag: the command carries it
    rendered = _render(tmp_path, _service(f"vllm/vllm-openai:v{NEWEST}", engine.model, flag))
    assert rendered.returncode == 0, rendered.stderr
    argv = _served_argv(rendered.stdout)
    assert argv[:2] == ["vllm", "serve"] and flag in argv, argv

    # the real engine of the older release cannot run it: it exits before serving, naming the flag
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    ran = subprocess.run(
        [engine.python, "-m", "vllm.entrypoints.cli.main", *argv[1:]],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert ran.returncode != 0, ran.stdout[-2000:]
    assert flag in ran.stderr, ran.stderr[-2000:]

    # rankguard refuses it for an image of the engine's release, before deploying, with names
    refused = _render(tmp_path, _service(f"vllm/vllm-openai:v{base}", engine.model, flag), "--check")
    assert refused.returncode != 0 and refused.stdout == ""
    assert flag in refused.stderr and f"vLLM {base}" in refused.stderr, refused.stderr
