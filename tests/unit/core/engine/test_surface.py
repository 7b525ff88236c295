"""rankguard's decision on extraArgs, and the fake vLLM's parser, held against the real vLLM.

tests/fixtures/vllm_argv_cases.json is written by hack/vllm-snapshot/run.sh from the real vLLM
0.33.0 package (`argv_cases.py`), and vllm_argv_cases_0.34.0.json from 0.34.0 (the first release
that sizes its KV cache after warm-up): 1,000+ extraArgs lists generated from vLLM's own parser
(every spelling of every option, a bad value for every typed one, good and bad objects for every
JSON option, prefixes, negative numbers, `-O`, the world-size, endpoint and memory options),
each with what vLLM does with the command a rankguard pod runs (`vllm serve MODEL <rendered
flags> <extraArgs>`): its parser's verdict (accepts, exits 2, crashes), its serve-args
validation, its own ParallelConfig (world size, context-parallel rules), what would listen on
the port, and whether the pod would run (`starts`). Each table is held against the rules of the
image that names its release.

The promise: rankguard never accepts a spec whose pod vLLM refuses or crash-loops, and where
it refuses one vLLM would run, the refusal is a decision with a reason (an owned flag, an
option a rankguard pod cannot be, a value it cannot check), never an accident.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.engine.owned_flags import OWNED, check_extra_args
from rankguard_operator.core.engine.rules import Rules, rules_for
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.surface import ACCEPTED, HOST_MEMORY, MEASURE_FIRST, NO_EFFECT, REFUSED
from rankguard_operator.core.engine.vllm_cli import HELP
from rankguard_operator.core.render.pod import vllm_args
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from rankguard_sim import vllm_snapshot as fake_release
from rankguard_sim.fake_vllm import args as fake_args
from tests import REPO

FIXTURES = REPO / "tests" / "fixtures"


@dataclass(frozen=True)
class Table:
    """One release's extraArgs table and the rules of the image that names that release."""

    doc: dict[str, Any]

    @property
    def version(self) -> str:
        return str(self.doc["vllm_version"])

    @property
    def cases(self) -> list[dict[str, Any]]:
        cases: list[dict[str, Any]] = self.doc["cases"]
        return cases

    @property
    def rules(self) -> Rules:
        return rules_for(self.version)

    @property
    def image(self) -> str:
        return f"vllm/vllm-openai:v{self.version}"


def _table(name: str) -> Table:
    return Table(json.loads((FIXTURES / name).read_text(encoding="utf-8")))


BASE_TABLE = _table("vllm_argv_cases.json")
TABLES = [BASE_TABLE, *(_table(p.name) for p in sorted(FIXTURES.glob("vllm_argv_cases_*.json")))]
TABLE: dict[str, Any] = BASE_TABLE.doc
CASES: list[dict[str, Any]] = BASE_TABLE.cases
RULES = BASE_TABLE.rules
IMAGE = BASE_TABLE.image
each_table = pytest.mark.parametrize("table", TABLES, ids=lambda t: t.version)

# Why rankguard may refuse a command vLLM would run: each is a decision the refusal names.
POLICY = re.compile(
    r"is owned by rankguard"  # an owned flag: the spec field to use instead
    r"|is refused:"  # an option a rankguard pod cannot run with (REFUSED)
    r"|is refused: a config file"
    r"|reads an item that starts with '-' and holds a '\.'"  # vLLM's reader eats or crashes on it
    r"|must be one of mp, uni"  # an executor other than vLLM's own two
    r"|--distributed-executor-backend ray is refused"
    r"|as null inside its list"  # `None` in a list option: null to vLLM, refused by its configs
    r"|cannot drive"  # the uni executor with more than one GPU
)


def spec_doc(extra: list[str], tp: int = TABLE["pod_gpus"], image: str = IMAGE) -> dict[str, Any]:
    return {
        "model": {"name": TABLE["model"]},
        "image": image,
        "tensorParallelSize": tp,
        "engine": {"extraArgs": extra},
    }


@cache
def decide(extra: tuple[str, ...], image: str = IMAGE) -> str | None:
    """None: rankguard accepts the spec; else its refusal."""
    try:
        parse_spec(spec_doc(list(extra), image=image))
    except SpecError as e:
        return str(e)
    return None


@each_table
def test_the_table_covers_every_kind_of_case(table: Table) -> None:
    cases, rules = table.cases, table.rules
    assert rules.version == table.version and rules.note is None
    groups = Counter(c["group"] for c in cases)
    assert len(cases) >= 300, len(cases)
    for group in (
        "spelling",
        "bad-value",
        "json",
        "prefix",
        "world",
        "endpoint",
        "memory",
        "help",
        "negative",
        "explicit",  # "0", "none", "false", "auto", -1 where an option's type takes them
        "config",  # what vLLM checks only when it builds its engine config
    ):
        assert groups[group] > 0, group
    # the config step ran: vLLM's engine config was built (or refused) for every case that got there
    built = [c["real"]["config"] for c in cases if c["real"]["parse"] == "ok" and "validate" not in c["real"]]
    assert (
        sum(1 for b in built if b == "ok") > 900
        and sum(1 for b in built if not b.startswith(("ok", "unj"))) > 200
    )
    # every JSON option has a good and a bad value; every owned option every spelling
    json_dests = set(rules.snapshot.surface["json_options"])
    flags_seen = {c["extra_args"][0].split(".")[0] for c in cases}
    for dest in json_dests | set(OWNED):
        option = rules.cli.option(dest)
        if option is None:  # an owned option of another release (vLLM 0.34's extensible KV cache)
            assert dest not in json_dests
            continue
        # vLLM's EnableDisableAction registers `--no-enable-x` beside `--disable-x` as a hidden
        # alias, which the generator (the action's option_strings) does not see; the owned one is
        # held in test_the_options_vllm_0_34_added
        hidden = {s for s in option.negative if s.startswith("--no-") and len(option.negative) > 1}
        assert set(option.spellings) - hidden <= flags_seen | {"--model"}, dest
    verdicts = Counter((c["real"]["parse"], c["real"]["starts"]) for c in cases)
    assert (
        verdicts[("ok", True)] > 300 and verdicts[("exit2", False)] > 100 and verdicts[("crash", False)] > 0
    )


@each_table
def judged_in_the_pod(real: dict[str, Any]) -> bool:
    """A refusal that hangs on what the apply-time rules cannot see: the real vLLM accepted the
    same command over another catalog model (argv_cases.py's `config_other_model`, a
    mixture-of-experts one, or `config_mqa_model`, one with a single KV head), or with the
    command's values present as files (`with_files`: a chat template in the image). The pod's own
    vLLM judges these before the engine starts (engine_judge.py)."""
    return "ok" in (real.get("config_other_model"), real.get("config_mqa_model"), real.get("with_files"))


def test_judged_in_the_pod_means_the_verdict_changed_with_the_model_or_the_files() -> None:
    pod = [c for t in TABLES for c in t.cases if not c["real"]["starts"] and judged_in_the_pod(c["real"])]
    assert any(c["real"].get("config_other_model") == "ok" for c in pod)  # -ep on a dense model
    assert any(c["real"].get("config_mqa_model") == "ok" for c in pod)  # -dcp 2 with 8 KV heads
    assert any(c["real"].get("with_files") == "ok" for c in pod)  # --chat-template auto, a file
    # the generator ran the other judgements on every case the config step refused
    for t in TABLES:
        for c in t.cases:
            refused = not c["real"].get("config", "ok").startswith(("ok", "unjudged"))
            assert refused == ("config_other_model" in c["real"]) == ("config_mqa_model" in c["real"]), c
            assert (refused or "validate" in c["real"]) == ("with_files" in c["real"]), c


@each_table
def test_rankguard_never_accepts_a_command_vllm_refuses_or_cannot_run(table: Table) -> None:
    wrong = []
    pod = 0
    for c in table.cases:
        if c["real"]["starts"] or decide(tuple(c["extra_args"]), table.image) is not None:
            continue
        if judged_in_the_pod(c["real"]):
            pod += 1  # the pod's own vLLM refuses it before the engine starts
            continue
        wrong.append(f"{c['extra_args']}: vLLM {c['real']}")
    assert not wrong, (
        f"{len(wrong)} accepted by rankguard, refused or crash-looped by vLLM for every model and "
        f"without the pod's files (besides {pod} judged in the pod: their verdict changes with the "
        "model or the files):\n" + "\n".join(wrong)
    )


@each_table
def test_every_refusal_of_a_command_vllm_would_run_is_a_decision_with_its_reason(table: Table) -> None:
    accidents = []
    policy: Counter[str] = Counter()
    for c in table.cases:
        if not c["real"]["starts"]:
            continue
        why = decide(tuple(c["extra_args"]), table.image)
        if why is None:
            continue
        m = POLICY.search(why)
        if m is None:
            accidents.append(f"{c['extra_args']}: {why}")
        else:
            policy[m.group(0)] += 1
    assert not accidents, f"{len(accidents)} refused for no policy:\n" + "\n".join(accidents)
    assert policy["is owned by rankguard"] > 30  # every spelling of every owned option


@each_table
def test_rankguard_accepts_the_commands_vllm_runs_unless_a_policy_says_no(table: Table) -> None:
    """The other side of the promise, counted: most of what vLLM runs is accepted."""
    runs = [c for c in table.cases if c["real"]["starts"]]
    accepted = [c for c in runs if decide(tuple(c["extra_args"]), table.image) is None]
    assert len(accepted) > 0.85 * len(runs), (len(accepted), len(runs))


def _fake_verdict(argv: list[str]) -> str:
    try:
        fake_args.parse_args(argv)
    except SystemExit as e:
        return f"exit{e.code}"
    except Exception:
        return "crash"
    return "ok"


@each_table
def test_the_fake_vllm_parses_every_case_as_the_real_parser_does(
    table: Table, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong = []
    with fake_release.playing(table.version) as played:
        assert played == table.version  # the fake plays the table's own release
        for c in table.cases:
            argv = ["serve", table.doc["model"], *table.doc["base_args"], *c["extra_args"]]
            got = _fake_verdict(argv)
            capsys.readouterr()  # argparse's usage text, for every refused case
            if got != c["real"]["parse"]:
                wrong.append(
                    f"{c['extra_args']}: fake {got}, vLLM {c['real']['parse']} {c['real'].get('message', '')}"
                )
    assert not wrong, f"{len(wrong)} of {len(table.cases)} differ:\n" + "\n".join(wrong)


@each_table
def test_the_table_base_is_what_rankguard_renders(table: Table) -> None:
    """The table's command carries the flags a rendered pod carries (dests, not values)."""
    spec = parse_spec(spec_doc([], image=table.image))
    rendered = vllm_args(spec, ServingFlags(kv_cache_memory_bytes=8 << 30), None)
    assert rendered[:2] == ["serve", table.doc["model"]]

    def dests(argv: list[str]) -> set[str]:
        return {w.option.dest for _, w in table.rules.cli.walk(argv)[0] if w.option is not None}

    assert dests(rendered[2:]) == dests(table.doc["base_args"])


def _ruled() -> set[str]:
    return set(OWNED) | set(REFUSED) | set(MEASURE_FIRST) | set(HOST_MEMORY) | set(NO_EFFECT) | set(ACCEPTED)


@each_table
def test_every_option_that_changes_the_world_the_endpoint_or_memory_has_a_ruling(table: Table) -> None:
    surface = table.rules.snapshot.surface
    touched = (
        set(surface["world_size"]["factors"]) | set(surface["endpoint_dests"]) | set(surface["memory_dests"])
    )
    assert touched - _ruled() == set(), "options the snapshot says matter that rankguard has no ruling on"


def test_every_ruling_names_an_option_of_a_recorded_release() -> None:
    known = {o["dest"] for v in vllm_snapshots.versions() for o in vllm_snapshots.load(v).cli["options"]}
    assert _ruled() - {HELP} - known == set(), "ruled on, but no recorded vLLM has such an option"


def test_every_option_a_newer_release_adds_has_a_ruling() -> None:
    """Owned, refused, measured first, held against host memory, or accepted with the reason."""
    plain = [v for v in vllm_snapshots.versions() if "+" not in v]
    for older, newer in itertools.pairwise(plain):
        if (vllm_snapshots.version_key(newer) or (0, 0, 0)) < (0, 34, 0):
            continue  # ruled on before this test existed: the surface test covers what matters there
        before = {o["dest"] for o in vllm_snapshots.load(older).cli["options"]}
        added = {o["dest"] for o in vllm_snapshots.load(newer).cli["options"]} - before
        assert added - _ruled() == set(), f"vLLM {newer} adds options rankguard has no ruling on"


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        (["--enable-extensible-kv-cache"], "decides who sizes the KV cache"),
        (["--no-enable-extensible-kv-cache"], "decides who sizes the KV cache"),
        (["--disable-extensible-kv-cache"], "decides who sizes the KV cache"),
        (["--checkpoint-prepare-on-startup"], "serves nothing until something calls /checkpoint/restore"),
        (["--headless-client-handshake-address", "tcp://10.0.0.1:5555"], "hands headless engines"),
        (["--max-num-inflight-kv-loads", "8"], None),
        (["--cache-aware-admission-window", "16", "--cache-aware-admission-threshold", "0.3"], None),
        (["--shuffle-safetensors-files"], None),
    ],
)
def test_the_options_vllm_0_34_added(extra: list[str], refusal: str | None) -> None:
    measured = next(t for t in TABLES if vllm_snapshots.load(t.version).extensible is not None)
    why = decide(tuple(extra), measured.image)
    assert (why is None) == (refusal is None), why
    if refusal is not None:
        assert why is not None and refusal in why and why.startswith("spec.engine.extraArgs[0]"), why
    # the estimate-sized release has none of them: its rules refuse each as unknown
    old = check_extra_args(extra, BASE_TABLE.rules.cli)
    assert old and "--" in old[0], old


def test_a_block_count_override_is_accepted_and_the_service_measured_first() -> None:
    """--num-gpu-blocks-override fixes the KV cache's size whatever rankguard plans, and keeps vLLM
    0.34 from measuring it (its sizing mode is pinned): accepted, the service measured first."""
    from rankguard_operator.core.model.resolve import resolve

    for table in TABLES:
        extra = ["--num-gpu-blocks-override", "1000"]
        assert decide(tuple(extra), table.image) is None, table.version
        doc = spec_doc(extra, image=table.image)
        doc["model"] = {"name": "meta-llama/Llama-3.1-8B-Instruct"}  # in the catalog: planned by default
        assert "block count" in resolve(parse_spec(doc), None, None).reason


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        (["--numa-bind-nodes", "1"], {"0.33.0": "needs --numa-bind", "0.34.0": None}),
        (
            ["--numa-bind-nodes", "1", "--no-numa-bind"],
            {"0.33.0": "needs --numa-bind", "0.34.0": "cannot be combined"},
        ),
        (["--numa-bind", "--numa-bind-nodes", "1"], {"0.33.0": None, "0.34.0": None}),
    ],
)
def test_numa_lists_turn_binding_on_from_0_34(extra: list[str], refused: dict[str, str | None]) -> None:
    for table in TABLES:
        why = decide(tuple(extra), table.image)
        want = refused[table.version]
        assert (why is None) == (want is None) and (want is None or want in str(why)), (table.version, why)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--he"], "--he is ambiguous to vLLM 0.33.0 (it could be --headless, --help)"),
        (["--help"], "--help is refused: prints the help and exits"),
        (["-pcp", "2"], "-pcp 2 multiplies vLLM's world size"),
        (["-dcp", "3"], "-dcp 3 must divide spec.tensorParallelSize (2)"),
        (["--headless"], "--headless is refused: starts no API server"),
        (["--api-server-count", "0"], "--api-server-count 0 starts no API server"),
        (["--ssl-keyfile", "k", "--ssl-certfile", "c"], "TLS at vLLM is not supported"),
        (["--distributed-executor-backend", "ray"], "ray is refused: a Ray executor"),
        (["--compilation-config", '{"level": 3}'], "$.level is not a key vLLM knows here (accepted keys: "),
        (
            ["--kv-transfer-config", "LMCache"],
            "--kv-transfer-config needs a JSON object, got 'LMCache' (not JSON)",
        ),
        (["--seed", "-0.5"], "a negative decimal crashes its parser"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["-dp", "2"], "is owned by rankguard; use spec.replicas"),
    ],
)
def test_refusals_name_the_item_and_say_what_to_do(extra: list[str], needle: str) -> None:
    why = decide(tuple(extra))
    assert why is not None and needle in why, why
    assert why.startswith("spec.engine.extraArgs[")


def test_measure_first_and_host_memory_options() -> None:
    from rankguard_operator.core.model.resolve import resolve

    def reason(extra: list[str]) -> str:
        doc = spec_doc(extra)
        doc["model"] = {"name": "meta-llama/Llama-3.1-8B-Instruct"}  # in the catalog: planned by default
        return resolve(parse_spec(doc), None, None).reason

    assert reason([]) == ""
    assert "decode context parallelism" in reason(["-dcp", "2"])
    assert "expert parallelism" in reason(["-ep"])
    assert "host memory" in reason(["--cpu-offload-gb", "4"])
    assert reason(["--no-enable-expert-parallel"]) == ""
    # a dotted piece sets its JSON option as the whole object does
    # (with its number of tokens: vLLM refuses an ngram method without one, config step of the table)
    spec = ["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens", "3"]
    assert "speculative decoding" in reason(spec)
    kvt = ["--kv-transfer-config.kv_connector=LMCacheConnectorV1", "--kv-transfer-config.kv_role=kv_both"]
    assert "KV connector" in reason(kvt)
    doc = spec_doc(["--cpu-offload-gb", "16"])
    doc["resources"] = {"limits": {"memory": "24Gi"}}
    with pytest.raises(SpecError, match=r"32Gi of host memory .*--cpu-offload-gb 16.*24Gi"):
        parse_spec(doc)
    doc["resources"] = {"limits": {"memory": "64Gi"}}
    parse_spec(doc)


def test_upper_case_values_vllm_lowercases_are_accepted() -> None:
    assert decide(("--moe-backend", "TRITON")) is None
    ns = fake_args.parse_args(["serve", "m", "--moe-backend", "TRITON"])
    assert isinstance(ns, argparse.Namespace) and ns.moe_backend == "triton"


def test_a_block_size_no_cuda_attention_backend_takes_is_refused() -> None:
    sizes = RULES.snapshot.surface["attention_block_sizes"]
    assert all(8 not in s and 16 in s for s in sizes.values() if s != sizes.get("TRITON_FLASHINFER"))
    doc = spec_doc([])
    doc["engine"]["blockSize"] = 8
    with pytest.raises(
        SpecError, match=r"blockSize 8 is supported by no CUDA attention backend .*16, 32, 64, 128"
    ):
        parse_spec(doc)
    doc["engine"]["blockSize"] = 16
    assert parse_spec(doc).engine.block_size == 16
