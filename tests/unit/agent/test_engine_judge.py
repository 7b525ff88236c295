"""The pod's own vLLM judges the engine's argv before the engine starts (issue 51).

The judge (engine_judge.py) runs as a real process under the interpreter the `vllm` command's
shebang names; where it cannot judge (no vLLM importable there, a judge that hangs, the judge
switched off) the engine starts as before. Judgements by a vLLM package: the sandbox image's
stand-in (sim/vllm_standin, below) here, the real one in tests/engine/test_engine_judge.py."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rankguard_agent import engine_judge
from rankguard_agent.__main__ import build_parser
from rankguard_agent.judge_run import (
    ACCEPTED,
    DEFAULT_JUDGE_TIMEOUT,
    JUDGE_SCRIPT,
    REFUSED,
    UNJUDGED,
    interpreter_of,
    judge_engine_args,
)
from rankguard_agent.wire.termination import (
    ENGINE_REFUSED,
    REASONS,
    TerminationMessage,
    parse_termination_message,
)
from rankguard_sim.kubelet.image import VLLM_STANDIN
from tests.unit.agent.launched import launcher_cmd, message


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _env(bin_dir: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    return env


# -- the interpreter, from the `vllm` command's shebang ----------------------------------------


def test_an_absolute_python_shebang_names_the_interpreter_with_its_options(tmp_path: Path) -> None:
    _script(tmp_path / "vllm", "#!/opt/venv/bin/python3.12 -s\nimport sys\n")
    got = interpreter_of(["vllm", "serve", "m"], {"PATH": str(tmp_path)})
    assert got == ["/opt/venv/bin/python3.12", "-s"]


def test_an_env_shebang_finds_python_on_the_engines_path(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = _script(bin_dir / "python3", "#!/bin/sh\n")
    _script(bin_dir / "vllm", "#!/usr/bin/env python3\n")
    assert interpreter_of(["vllm", "serve", "m"], {"PATH": str(bin_dir)}) == [str(python)]


@pytest.mark.parametrize(
    ("name", "text", "command"),
    [
        ("vllm", '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n', ["vllm", "serve", "m"]),
        ("vllm", "\x7fELF", ["vllm", "serve", "m"]),  # a binary
        ("vllm", "#!python3\n", ["vllm", "serve", "m"]),  # not absolute: the kernel would not run it
        ("vllm", "#!/usr/bin/env -S perl\n", ["vllm", "serve", "m"]),
        ("vllm", "#!/usr/bin/python3\n", ["vllm", "bench", "m"]),  # not `serve`
        ("python3", "#!/usr/bin/python3\n", ["python3", "-m", "vllm.entrypoints.openai.api_server"]),
    ],
)
def test_anything_else_is_not_judged(tmp_path: Path, name: str, text: str, command: list[str]) -> None:
    _script(tmp_path / name, text)
    assert interpreter_of(command, {"PATH": str(tmp_path)}) is None


def test_a_command_not_on_the_path_is_not_judged(tmp_path: Path) -> None:
    assert interpreter_of(["vllm", "serve", "m"], {"PATH": str(tmp_path)}) is None


# -- the judge's own words ------------------------------------------------------------------


def test_argparse_error_is_quoted_with_what_vllm_adds_after_it() -> None:
    stderr = (
        "INFO some log line\nusage: vllm serve [model_tag] [options]\n"
        "vllm serve: error: unrecognized arguments: --task embed\n"
        "\nHint: --task is not a vllm serve option.\n"
    )
    assert engine_judge.argparse_error(stderr) == (
        "vllm serve: error: unrecognized arguments: --task embed\nHint: --task is not a vllm serve option."
    )
    assert engine_judge.argparse_error("ValueError: nope\n") is None


@pytest.mark.parametrize(
    "argv",
    [["bench", "m"], ["serve", "m", "--omni"], ["serve", "m", "--grpc"], ["serve", "m", "--grpc=true"]],
)
def test_routes_the_judge_cannot_stop_short_of_serving_are_not_judged(argv: list[str]) -> None:
    # decided before vLLM is imported: this process has no vLLM at all
    assert engine_judge.judge(argv)["verdict"] == UNJUDGED


def test_without_vllm_the_judge_writes_unjudged(tmp_path: Path) -> None:
    result = tmp_path / "verdict.json"
    done = subprocess.run(
        [sys.executable, str(JUDGE_SCRIPT), str(result), "serve", "m"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(result.read_text())
    assert doc["verdict"] == UNJUDGED and "ModuleNotFoundError" in doc["message"], doc
    assert doc["vllm_version"] is None and isinstance(doc["seconds"], float)


def test_the_judge_does_not_see_the_agent_packages_modules(tmp_path: Path) -> None:
    """Run as a script its folder would be sys.path[0]: the agent's `probe`, `runtime`, `gpu` ...
    would shadow the engine's own top-level modules of those names."""
    fake = tmp_path / "vllm" / "entrypoints" / "cli"
    fake.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints"):
        (d / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("import probe\n")  # the agent has a probe.py beside the judge
    result = tmp_path / "verdict.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    subprocess.run(
        [sys.executable, str(JUDGE_SCRIPT), str(result), "serve", "m"],
        env=env,
        capture_output=True,
        timeout=60,
        check=True,
    )
    doc = json.loads(result.read_text())
    assert doc["verdict"] == UNJUDGED and "No module named 'probe'" in doc["message"], doc


# -- running it: bounded, switched off, stopped ----------------------------------------------


def test_the_judge_off_is_not_run(tmp_path: Path) -> None:
    _script(tmp_path / "vllm", f"#!{sys.executable}\n")
    judged = judge_engine_args(["vllm", "serve", "m"], {"PATH": str(tmp_path)}, timeout=0)
    assert judged.verdict == UNJUDGED and "--judge-timeout 0" in judged.message


def _hanging_python(tmp_path: Path) -> tuple[Path, Path]:
    """A `vllm` whose interpreter never answers (a hub that never replies), and the file the
    grandchild it leaves in its group writes its pid to."""
    pidfile = tmp_path / "grandchild.pid"
    python = _script(tmp_path / "python3", f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    _script(tmp_path / "vllm", f"#!{python}\n")
    return python, pidfile


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a killed child of the killed shell is a zombie until init reaps it
        try:
            stat_line = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return True
        if stat_line.rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_judge_past_its_timeout_is_killed_with_its_group_and_the_engine_starts_unjudged(
    tmp_path: Path,
) -> None:
    _, pidfile = _hanging_python(tmp_path)
    start = time.monotonic()
    judged = judge_engine_args(["vllm", "serve", "m"], _env(tmp_path), timeout=1.0)
    assert judged.verdict == UNJUDGED and "within 1 s" in judged.message, judged
    assert 1.0 <= judged.seconds < 30 and time.monotonic() - start < 30
    assert _gone(int(pidfile.read_text())), "the judge's grandchild outlived it"


def test_a_stopping_pod_stops_the_judge(tmp_path: Path) -> None:
    _, pidfile = _hanging_python(tmp_path)
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    judged = judge_engine_args(["vllm", "serve", "m"], _env(tmp_path), timeout=120, cancel=cancel)
    assert judged.verdict == UNJUDGED and "told to stop" in judged.message, judged
    assert judged.seconds < 60
    assert _gone(int(pidfile.read_text()))


# -- the launcher: an unjudged engine starts as before ---------------------------------------


def test_an_engine_the_judge_cannot_judge_starts_as_before(sim_env: dict[str, str], tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # a Python `vllm` in an image without a vllm package: the judge cannot import it
    _script(bin_dir / "vllm", f"#!{sys.executable}\nprint('engine ran', flush=True)\n")
    tlog = tmp_path / "tl"
    proc = subprocess.run(
        launcher_cmd(tlog, ["vllm", "serve", "m"]),
        env=_env(bin_dir, sim_env),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert b"engine ran" in proc.stdout
    assert b"did not judge the engine's arguments" in proc.stderr
    assert message(tlog).reason == "Completed"


def test_the_refusal_reason_is_a_termination_reason_of_its_own() -> None:
    assert ENGINE_REFUSED == "EngineRefusedArguments" and ENGINE_REFUSED in REASONS
    text = TerminationMessage(ENGINE_REFUSED, 2, detail="vllm serve: error: x").to_json()
    parsed = parse_termination_message(text)
    assert (parsed.reason, parsed.exit_code, parsed.detail) == (ENGINE_REFUSED, 2, "vllm serve: error: x")


# -- a vLLM package judges: the sandbox image's stand-in (sim/vllm_standin) -------------------

STANDIN = VLLM_STANDIN  # the sandbox image's `vllm` package's folder (never on our path)
SCENARIO = "llama3-8b-tp2-24gb"
MODEL = "meta-llama/Meta-Llama-3-8B"
GOOD = ["serve", MODEL, "--tensor-parallel-size", "2"]


def _standin_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{path}{os.pathsep}{STANDIN}" if path else str(STANDIN)
    env["RANKGUARD_SIM_SCENARIO"] = SCENARIO
    return env


def _judge(tmp_path: Path, argv: list[str], *, scenario: bool = True) -> dict[str, object]:
    result = tmp_path / "verdict.json"
    env = _standin_env()
    if not scenario:
        del env["RANKGUARD_SIM_SCENARIO"]
    done = subprocess.run(
        [sys.executable, str(JUDGE_SCRIPT), str(result), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(json.loads(result.read_text()))


@pytest.mark.parametrize(
    ("argv", "verdict", "words"),
    [
        (GOOD, ACCEPTED, ""),
        # the parser's own error line, quoted
        ([*GOOD, "--no-such-flag"], REFUSED, "error: unrecognized arguments: --no-such-flag"),
        # help printed and exit 0: the engine would never serve
        ([*GOOD, "--help"], REFUSED, "help or version"),
        # a ValueError vLLM raises while building its configuration
        ([*GOOD, "--max-model-len", "999999999"], REFUSED, "ValueError: User-specified max_model_len"),
    ],
)
def test_the_images_vllm_judges_as_it_would_start(
    tmp_path: Path, argv: list[str], verdict: str, words: str
) -> None:
    doc = _judge(tmp_path, argv)
    assert doc["verdict"] == verdict, doc
    assert words in str(doc["message"]), doc
    assert isinstance(doc["vllm_version"], str) and doc["vllm_version"], doc


def test_what_the_image_cannot_judge_is_not_a_refusal(tmp_path: Path) -> None:
    # a model the sandbox has no world for: its own limit (a RuntimeError), not vLLM's refusal
    doc = _judge(tmp_path, ["serve", "no/such-model"], scenario=False)
    assert doc["verdict"] == UNJUDGED and "SandboxCannotJudge" in str(doc["message"]), doc


def _console_script(bin_dir: Path, ran: Path) -> None:
    """The image's `vllm` console script, as pip writes one (a Python shebang); run as the engine
    it leaves `ran` behind and exits 0, so a test sees whether the engine was started."""
    bin_dir.mkdir(exist_ok=True)
    _script(
        bin_dir / "vllm",
        f"#!{sys.executable}\nimport pathlib\npathlib.Path({str(ran)!r}).touch()\nprint('engine ran')\n",
    )


def _launch(
    sim_env: dict[str, str], tmp_path: Path, argv: list[str], *options: str
) -> tuple[subprocess.CompletedProcess[bytes], Path, Path]:
    """The launcher run on `vllm ARGV` whose engine only marks that it ran: (the run, the
    engine's mark, the termination log)."""
    bin_dir, ran, tlog = tmp_path / "bin", tmp_path / "engine-ran", tmp_path / "tl"
    _console_script(bin_dir, ran)
    proc = subprocess.run(
        launcher_cmd(tlog, ["vllm", *argv], *options),
        env=_env(bin_dir, _standin_env(sim_env)),
        capture_output=True,
        timeout=120,
        check=False,
    )
    return proc, ran, tlog


def test_a_refusal_ends_the_container_with_vllms_words_and_the_engine_never_starts(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    proc, ran, tlog = _launch(sim_env, tmp_path, [*GOOD, "--max-model-len", "999999999"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert not ran.exists(), "the engine was started after vLLM refused its arguments"
    m = message(tlog)
    assert (m.reason, m.exit_code) == (ENGINE_REFUSED, 2)
    assert m.detail is not None and m.detail.startswith("ValueError: User-specified max_model_len"), m
    assert b"refused the engine's arguments" in proc.stderr and b"999999999" in proc.stderr


def test_a_refusal_on_a_pod_of_a_group_says_its_place(sim_env: dict[str, str], tmp_path: Path) -> None:
    proc, ran, tlog = _launch(
        sim_env, tmp_path, [*GOOD, "--nnodes", "2", "--node-rank", "1", "--headless", "--no-such-flag"]
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    m = message(tlog)
    assert (m.reason, m.node_rank, m.nnodes) == (ENGINE_REFUSED, 1, 2), m
    assert m.detail is not None and "unrecognized arguments: --no-such-flag" in m.detail
    assert not ran.exists()


def test_accepted_arguments_start_the_engine(sim_env: dict[str, str], tmp_path: Path) -> None:
    proc, ran, tlog = _launch(sim_env, tmp_path, [*GOOD])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ran.exists() and b"engine ran" in proc.stdout
    assert b"accepted the engine's arguments" in proc.stderr
    assert message(tlog).reason == "Completed"


def test_judge_timeout_zero_starts_a_refusable_engine_unjudged(
    sim_env: dict[str, str], tmp_path: Path
) -> None:
    proc, ran, _ = _launch(sim_env, tmp_path, [*GOOD, "--no-such-flag"], "--judge-timeout", "0")
    assert proc.returncode == 0 and ran.exists(), proc.stderr[-2000:]


def test_judge_timeout_option() -> None:
    parser = build_parser()
    assert parser.parse_args(["launch"]).judge_timeout == DEFAULT_JUDGE_TIMEOUT
    assert parser.parse_args(["launch", "--judge-timeout", "0"]).judge_timeout == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["launch", "--judge-timeout", "-1"])
