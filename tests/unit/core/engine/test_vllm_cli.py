"""vLLM's `vllm serve` CLI read from the recorded snapshot: owned options with every alias, extraArgs
checked as vLLM would check them, every argv rankguard renders valid for the real parser, and the
CRD's first-line regex in step with the snapshot."""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any

import pytest
import yaml

from rankguard_operator import vllm_snapshots
from rankguard_operator.core.budget.bounds import prior_plan
from rankguard_operator.core.engine.owned_flags import (
    OWNED,
    check_extra_args,
    conflicting_flags,
    owned_spellings,
)
from rankguard_operator.core.engine.rules import image_version, rules_for, rules_for_image
from rankguard_operator.core.engine.serving_flags import ServingFlags
from rankguard_operator.core.engine.vllm_cli import convert
from rankguard_operator.core.render.pod import vllm_args
from rankguard_operator.core.spec.fields import SpecError
from rankguard_operator.core.spec.parse import parse_spec
from tests import REPO

CLI = rules_for("0.33.0").cli


def test_owned_options_carry_every_alias_vllm_has() -> None:
    spellings = owned_spellings(CLI)
    # the aliases that bypassed the old hand list, read from vLLM's own parser
    assert spellings["--device-memory-utilization"] == "gpu_memory_utilization"
    assert spellings["--no-enforce-eager"] == "enforce_eager"
    assert spellings["-tp"] == "tensor_parallel_size"
    assert spellings["--config"] == "config"
    # every owned dest exists in the newest vLLM (a rename would silently un-own it); an older one
    # lacks only the options that came later (0.34's extensible KV cache switch)
    newest = rules_for(vllm_snapshots.latest().version).cli
    assert {d for d in OWNED if newest.option(d) is None} == set()
    assert {d for d in OWNED if CLI.option(d) is None} == {"enable_extensible_kv_cache"}
    assert set(newest.spellings("enable_extensible_kv_cache")) <= set(owned_spellings(newest))


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["--kv-cache-memory-bytes=1"], ["--kv-cache-memory-bytes"]),
        (["--kv_cache_memory_bytes", "1"], ["--kv-cache-memory-bytes"]),
        (["-tp", "8", "-pp=2"], ["--tensor-parallel-size", "--pipeline-parallel-size"]),
        (["--no-enforce-eager"], ["--enforce-eager"]),
        (["--device-memory-utilization", "0.5"], ["--gpu-memory-utilization"]),
        (["--max-model", "4096"], ["--max-model-len"]),  # argparse's unambiguous prefix
        (["--num-gpu-blocks-override", "100"], []),  # accepted: the service is measured first
        (["--port", "9000", "--host=0.0.0.0"], ["--port", "--host"]),
        (["--model", "x", "--model=y"], ["--model"]),
        (["--config", "serve.yaml"], ["--config"]),
        (["-dp", "2"], ["--data-parallel-size"]),
        (["--enable-prefix-caching", "--served-model-name", "llama", "--seed", "-1"], []),
        (["--max-num", "3"], []),  # ambiguous prefix: vLLM refuses it itself (reported elsewhere)
        (["--model-impl", "vllm", "-O3"], []),
        (["-q", "awq"], ["--quantization"]),  # it sizes the weights: spec.model.quantization
    ],
)
def test_conflicting_flags(args: list[str], flags: list[str]) -> None:
    assert conflicting_flags(args, CLI) == flags


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--max-num-seqs 64"], "write it as separate items: '--max-num-seqs', '64'"),
        (["--enable-prefix-cachin"], ""),  # a unique prefix: vLLM accepts it
        (
            ["--enable-prefix-cashing"],
            "has no option --enable-prefix-cashing (did you mean --enable-prefix-caching?)",
        ),
        (["--seed", "abc"], "--seed needs an integer, got 'abc'"),
        (["--swap-space"], "vLLM 0.33.0 has no option --swap-space"),
        (["--enable-prefix-caching=true"], "--enable-prefix-caching takes no value"),
        (["64"], "a value without a flag before it"),
        (["--served-model-name"], "--served-model-name needs a value"),
        (["--override-generation-config", "{not json"], "needs JSON"),
        (["--max-num-queued-tokens", "2k"], ""),
        (["--enable-chunked-prefill", "--disable-log-stats"], ""),
        (["--gpu-memory-utilization", "0.5"], "use spec.memory.gpuMemoryUtilization instead"),
        (["--config", "x.yaml"], "--config is refused"),
    ],
)
def test_extra_args_are_read_as_vllm_reads_them(args: list[str], fragment: str) -> None:
    problems = check_extra_args(args, CLI)
    if fragment:
        assert any(fragment in p for p in problems), problems
        assert all(p.startswith("spec.engine.extraArgs[") for p in problems)
    else:
        assert problems == []


def test_an_invalid_item_is_refused_at_parse_time_naming_it() -> None:
    doc = {"model": {"name": "meta-llama/Meta-Llama-3-8B"}, "image": "vllm/vllm-openai:v0.33.0"}
    doc["engine"] = {"extraArgs": ["--enable-prefix-caching", "--max-num-seqs 64"]}
    with pytest.raises(SpecError, match=re.escape("spec.engine.extraArgs[1] '--max-num-seqs 64'")):
        parse_spec(doc)


@pytest.mark.parametrize(
    ("type_name", "text", "value"),
    [
        ("human_readable_int", "1k", 1000),
        ("human_readable_int", "1K", 1024),
        ("human_readable_int", "25.6k", 25600),
        ("human_readable_int", "80G", 80 << 30),
        ("human_readable_int_or_auto", "auto", -1),
        ("human_readable_int_or_auto", "-1", -1),
        ("int", "7", 7),
        ("float", "0.5", 0.5),
    ],
)
def test_value_types_follow_vllm(type_name: str, text: str, value: Any) -> None:
    assert convert({"name": type_name}, text) == value


@pytest.mark.parametrize("text", ["1.5K", "ten", "1 k"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        convert({"name": "human_readable_int"}, text)


# --- every argv rankguard renders parses with the real vLLM's rules ------------------------------

BASE: dict[str, Any] = {
    "model": {"name": "meta-llama/Meta-Llama-3-70B"},
    "image": "vllm/vllm-openai:v0.33.0",
}
ENGINES: list[dict[str, Any]] = [
    {},
    {"maxModelLen": 8192, "maxNumSeqs": 64, "maxNumBatchedTokens": 4096},
    {"blockSize": 32, "dtype": "bfloat16", "kvCacheDtype": "fp8", "enforceEager": True},
    {"logitsMode": "gather", "extraArgs": ["--enable-prefix-caching", "--served-model-name", "a", "b"]},
    {"extraArgs": ["--max-num-queued-tokens=2k", "-O3", "--compilation-config.cudagraph_mode", "NONE"]},
]
SPLITS = [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2)]
BUDGETS = [
    ServingFlags(),  # vLLM's default
    ServingFlags(gpu_memory_utilization=0.9),
    ServingFlags(kv_cache_memory_bytes=20 << 30),  # planned/remediated
]
MEMORIES: list[dict[str, Any]] = [{}, {"gpuMemoryBytes": 80 << 30}, {"kvCacheMemoryBytes": 10 << 30}]


@pytest.mark.parametrize(("split", "engine", "memory"), list(itertools.product(SPLITS, ENGINES, MEMORIES)))
def test_every_rendered_argv_passes_the_snapshot_parser(
    split: tuple[int, int], engine: dict[str, Any], memory: dict[str, Any]
) -> None:
    doc = copy.deepcopy(BASE)
    doc.update(tensorParallelSize=split[0], pipelineParallelSize=split[1], engine=engine, memory=memory)
    spec = parse_spec(doc)
    for flags in BUDGETS:
        argv = vllm_args(spec, flags, prior_plan(spec))
        assert CLI.check_serve([a.replace("$(POD_IP)", "10.0.0.1") for a in argv]) == [], argv
        # the block size is vLLM's choice unless the spec sets it
        assert ("--block-size" in argv) == ("blockSize" in engine), argv


def test_a_bad_argv_is_caught() -> None:
    assert CLI.check_serve(["serve", "m", "--max-num-seqs", "x"]) == [
        "[0] '--max-num-seqs': --max-num-seqs needs an integer, got 'x'"
    ]
    assert CLI.check_serve(["--model", "m"]) == ["the command must be `vllm serve MODEL …`"]


# --- the CRD's CEL regex is a first line of defence, in step with the snapshot -------------------


CRD = REPO / "crds" / "llmservice.yaml"


def _crd_extra_args_regex() -> re.Pattern[str]:
    doc = yaml.safe_load(CRD.read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rule = spec["properties"]["engine"]["properties"]["extraArgs"]["x-kubernetes-validations"][0]
    m = re.search(r"a\.matches\('(.+)'\)\)", rule["rule"])
    assert m is not None
    return re.compile(m.group(1))


@pytest.mark.parametrize("version", ["0.33.0", vllm_snapshots.latest().version])
def test_the_crd_refuses_exactly_the_owned_spellings(version: str) -> None:
    """Every spelling of every option in the snapshot: the CRD refuses it (as written, with `_`,
    with `=value`) iff rankguard owns it, so apply-time and operator agree."""
    regex = _crd_extra_args_regex()
    cli = rules_for(version).cli
    owned = owned_spellings(cli)
    for option in cli.options:
        for s in option.spellings:
            variants = [s, s + "=1"] + ([s[:2] + s[2:].replace("-", "_")] if s.startswith("--") else [])
            for v in variants:
                assert bool(regex.match(v)) == (s in owned), v


# --- which snapshot applies --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "version"),
    [
        ("vllm/vllm-openai:v0.33.0", "0.33.0"),
        ("registry.local:5000/vllm/vllm-openai:0.33.0-cu129", "0.33.0"),
        ("vllm/vllm-openai:latest", None),
        ("vllm/vllm-openai@sha256:" + "a" * 64, None),
        ("vllm/vllm-openai", None),
    ],
)
def test_image_version(image: str, version: str | None) -> None:
    assert image_version(image) == version


def test_unknown_versions_fall_back_and_say_so() -> None:
    assert rules_for_image("vllm/vllm-openai:v0.33.0").note is None
    newer = rules_for("99.0.0")
    assert newer.version == vllm_snapshots.versions()[-1] and "nearest older" in (newer.note or "")
    older = rules_for("0.1.0")
    assert older.version == vllm_snapshots.versions()[0] and "0.1.0" in (older.note or "")
    assert "not a version" in (rules_for("nightly").note or "")
    assert rules_for(None).note is None
