"""The fake's judge (its parser, then its create_engine_config) against the real vLLM's verdict
at config build, on every case of the extraArgs tables (tests/fixtures/vllm_argv_cases*.json,
`real.config`: what the real AsyncEngineArgs.create_engine_config said over Llama-3-8B's
config.json): the fake never refuses what the real builds, and refuses what the real refuses on
the options whose checks it plays (PLAYED). The real refuses ~260 cases per release at config
build; the rest are checks the fake does not play (pydantic bounds of options the world does not
model, compilation / speculative / KV-transfer / mamba / multimodal configs, --nnodes 0,
--node-rank -1, ...): there the sandbox's engine accepts, and the pod's real vLLM refuses."""

from __future__ import annotations

import json
import re
from typing import Any

from rankguard_sim.fake_vllm.args import options, parse_args
from rankguard_sim.fake_vllm.config_checks import SandboxCannotJudge, judge_config
from rankguard_sim.physics.scenario_file import SCENARIO_ENV
from rankguard_sim.vllm_snapshot import playing
from tests import REPO

FIXTURES = REPO / "tests" / "fixtures"
# Llama-3-8B at TP2 on two cards: the model and pod the tables were recorded for
WORLD = {SCENARIO_ENV: "llama3-8b-tp2-24gb"}
# ValidationError: pydantic's, a ValueError
REFUSED = re.compile(r"^(ValueError|ValidationError|TypeError|NotImplementedError)\b")
# The options whose config-build refusals the fake plays (engine_config, config_checks)
PLAYED = {
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_cudagraph_capture_size",
    "gpu_memory_utilization",
    "kv_cache_dtype",
    "block_size",
    "runner",
    "convert",
}
# ... except these cases of them: SchedulerConfig's max_num_batched_tokens >= max_num_seqs
NOT_PLAYED_CASES = ({"max_num_batched_tokens": "1"},)


def _tables() -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(FIXTURES.glob("vllm_argv_cases*.json"))]


def _config_cases() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    out = []
    for table in _tables():
        for case in table["cases"]:
            if "config" in case.get("real", {}):
                out.append((str(table["vllm_version"]), table, case))
    return out


def fake_config(release: str, table: dict[str, Any], extra: list[str]) -> str:
    """The fake judge's verdict: "ok", "refused: <message>", "unjudged: <why>" or "parse: <status>"."""
    with playing(release):
        try:
            args = parse_args(["serve", str(table["model"]), *table["base_args"], *extra])
        except SystemExit as e:
            return f"parse: {e.code}"
        try:
            judge_config(args, WORLD)
        except SandboxCannotJudge as e:
            return f"unjudged: {e}"
        except (ValueError, TypeError, NotImplementedError) as e:
            return f"refused: {e}"
    return "ok"


CASES = _config_cases()


def _dest(flag: str) -> str | None:
    """The option a flag spells (a full spelling, or the one option it abbreviates)."""
    name = flag.split("=", 1)[0]
    found = {o["dest"] for o in options() for s in o["option_strings"] if s == name}
    found = found or {o["dest"] for o in options() for s in o["option_strings"] if s.startswith(name)}
    return found.pop() if len(found) == 1 else None


def _not_played(dest: str, extra: list[str]) -> bool:
    value = extra[0].split("=", 1)[1] if "=" in extra[0] else (extra[1] if len(extra) > 1 else None)
    return any(case.get(dest) == value for case in NOT_PLAYED_CASES)


def test_the_fake_never_refuses_what_the_real_builds_and_refuses_what_it_plays() -> None:
    assert CASES, "no table records the real config build (real.config): regenerate them (run.sh)"
    false_refusals, missed = [], []
    for release, table, case in CASES:
        real = str(case["real"]["config"])
        extra = [str(a) for a in case["extra_args"]]
        if real != "ok" and not REFUSED.match(real):
            continue  # unjudged by the real build (this machine's, not vLLM's verdict)
        fake = fake_config(release, table, extra)
        if real == "ok":
            if fake.startswith("refused"):
                false_refusals.append(f"{release} {extra}: {fake}")
            continue
        with playing(release):
            dest = _dest(extra[0]) if extra else None
        if dest in PLAYED and not _not_played(dest, extra) and not fake.startswith("refused"):
            missed.append(f"{release} {extra}: real {real!r}, fake {fake}")
    assert not false_refusals, "the fake refuses what the real vLLM builds:\n" + "\n".join(false_refusals)
    assert not missed, "the real vLLM refuses at config build, the fake does not:\n" + "\n".join(missed)


def test_the_fake_refuses_nothing_the_base_command_builds() -> None:
    """The base command every table case extends: the real builds it; so must the fake."""
    for table in _tables():
        assert fake_config(str(table["vllm_version"]), table, []) == "ok"


def test_the_comparison_sees_a_refusal() -> None:
    """The fake's judge reports a refusal it plays (so the table test can fail)."""
    table = _tables()[0]
    assert fake_config("0.33.0", table, ["--max-model-len", "100000"]).startswith("refused: ")
