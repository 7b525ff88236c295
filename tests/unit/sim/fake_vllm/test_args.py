"""The fake `vllm serve`'s command line and pure pieces, without starting it: its parser is the
recorded vLLM snapshot's (every option, every spelling, vLLM's value types), and its flag
resolution, device narrowing and sampler warm-up match vLLM's."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankguard_sim.fake_vllm import arg_types
from rankguard_sim.fake_vllm import args as vllm_args
from rankguard_sim.fake_vllm import console as vllm_console
from rankguard_sim.fake_vllm import ledger as vllm_ledger
from rankguard_sim.fake_vllm.args import config_from_args, parse_args
from rankguard_sim.physics.engine_config import EngineConfig, EngineConfigError
from rankguard_sim.physics.engine_failures import CudaOutOfMemory, SamplerWarmupOOM
from rankguard_sim.physics.engine_memory import TAG_TRANSIENT
from rankguard_sim.physics.gpus import IMEX_CHANNELS_GLOB_ENV
from rankguard_sim.physics.scenario_file import load_scenario
from rankguard_sim.vllm_snapshot import playing, snapshot

GIB = 1 << 30
MIB = 1 << 20


# -- pure helpers -------------------------------------------------------------------------------


def test_vllm_size_syntax_and_flexible_flag_names() -> None:
    assert arg_types.human_readable_int("25k") == 25_000
    assert arg_types.human_readable_int("25K") == 25 * 1024
    assert arg_types.human_readable_int("2G") == 2 * GIB
    assert arg_types.human_readable_int("1234") == 1234
    assert vllm_args.normalize_argv(["serve", "m_x", "--max_model_len=8", "--kv_cache_dtype", "fp8"]) == [
        "serve",
        "m_x",
        "--max-model-len=8",
        "--kv-cache-dtype",
        "fp8",
    ]
    args = vllm_args.parse_args(
        ["serve", "m", "-tp", "4", "--kv_cache_memory_bytes", "30G", "--no-enforce-eager"]
    )
    assert (args.tensor_parallel_size, args.kv_cache_memory_bytes, args.enforce_eager) == (4, 30 * GIB, False)


def test_cuda_visible_devices_narrows_the_pods_gpus() -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c", "CUDA_VISIBLE_DEVICES": "2,0"}
    assert vllm_ledger.select_gpus(env) == ["GPU-c", "GPU-a"]
    assert vllm_ledger.select_gpus({"NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b"}) == ["GPU-a", "GPU-b"]


def test_sampler_warmup_oom_is_chained_like_vllm() -> None:
    oom = CudaOutOfMemory(
        1,
        "sampler-warmup",
        nbytes=300 * MIB,
        free=10 * MIB,
        total=80 * GIB,
        process_bytes=79 * GIB,
        torch_allocated=70 * GIB,
        private_pools=0,
        what=TAG_TRANSIENT,
    )
    lines = vllm_console.failure_lines(SamplerWarmupOOM(oom, 256))
    text = "\n".join(lines)
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 300.00 MiB. GPU 1 " in text
    assert "The above exception was the direct cause of the following exception:" in text
    assert lines[-1].startswith(
        "RuntimeError: CUDA out of memory occurred when warming up sampler with 256 dummy"
    )


# -- the parser is the snapshot's (vLLM 0.33.0) -------------------------------------------------

SAMPLES = {
    "str": "x",
    "int": "3",
    "float": "0.5",
    "human_readable_int": "2k",
    "human_readable_int_or_auto": "auto",
    "json": '{"a": 1}',
    "opaque": "{}",  # parse_dataclass: every recorded dataclass takes an empty object
}
CONVERTED = {"int": 3, "float": 0.5, "human_readable_int": 2000, "human_readable_int_or_auto": -1}


def sample(opt: dict[str, object]) -> tuple[str, object]:
    """A value the real vLLM accepts for this option (from its type or choices), and what it parses to."""
    choices = opt.get("choices")
    type_doc = opt.get("type")
    assert isinstance(type_doc, dict)
    name = str(type_doc["name"])
    if name == "optional":
        of = type_doc["of"]
        assert isinstance(of, dict)
        name = str(of["name"])
    if isinstance(choices, list):
        value = next(c for c in choices if c is not None)
        return str(value), value
    if opt["dest"] in snapshot().surface.get("custom_options", {}):
        return "a=b", "a=b"  # vLLM's own item reader (`--lora-modules`): name=path
    raw = SAMPLES[name]
    if name == "json":
        return raw, {"a": 1}
    if name == "opaque" and "parse_dataclass" in str(type_doc):
        return raw, {}
    return raw, CONVERTED.get(name, raw)


def test_the_parser_accepts_every_option_of_the_snapshot_with_every_spelling() -> None:
    opts = vllm_args.options()
    assert len(opts) == len(snapshot().cli["options"]) > 300
    for opt in opts:
        dest = str(opt["dest"])
        strings = [str(s) for s in opt["option_strings"]]
        for spelling in strings:
            if opt["kind"] == "switch":
                negative = spelling in opt.get("negative_option_strings", [])
                ns = vllm_args.parse_args(["serve", "m", spelling])
                assert getattr(ns, dest) is (not negative), (dest, spelling)
                continue
            if opt["kind"] == "true":
                assert getattr(vllm_args.parse_args(["serve", "m", spelling]), dest) is True, spelling
                continue
            raw, expected = sample(opt)
            if dest == "model":  # vLLM moves `--model X` to the positional (FlexibleArgumentParser)
                assert vllm_args.parse_args(["serve", spelling, raw]).model_tag == raw
                continue
            if dest == "config":  # vLLM reads the YAML file before argparse: `x` is not one
                with pytest.raises(ValueError, match="Config file must be of a yaml/yml type"):
                    vllm_args.parse_args(["serve", "m", spelling, raw])
                continue
            ns = vllm_args.parse_args(["serve", "m", spelling, raw])
            got = getattr(ns, dest)
            if opt["nargs"] in ("+", "*") or opt["kind"] == "append":
                assert got == [expected], (dest, spelling, got)
            else:
                assert got == expected, (dest, spelling, got)


@pytest.mark.parametrize(
    "argv",
    [
        ["--frobnicate", "3"],  # not a vLLM option
        ["--max-num-seqs", "many"],  # int
        ["--gpu-memory-utilization", "most"],  # float
        ["--kv-cache-memory-bytes", "1.5G"],  # human_readable_int: no decimals with a binary suffix
        ["--max-model-len", "long"],  # human_readable_int_or_auto
        ["--dtype", "int3"],  # choices
        ["--allowed-headers", "{not json"],  # json
        ["--enforce-eager", "yes"],  # a switch takes no value
        ["--max-num", "3"],  # an ambiguous prefix (--max-num-seqs, --max-num-batched-tokens, ...)
    ],
)
def test_unknown_flags_and_bad_values_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        vllm_args.parse_args(["serve", "m", *argv])
    assert exited.value.code == 2


def test_real_vllm_spellings_that_the_old_fake_refused() -> None:
    ns = vllm_args.parse_args(
        [
            "serve",
            "m",
            "--enable-chunked-prefill",
            "--max-model-len",
            "auto",
            "--device-memory-utilization",  # a hidden alias of --gpu-memory-utilization
            "0.5",
            "--max_num_batched_tokens=4k",  # underscores and =
            "--max-num-se",  # an unambiguous prefix (argparse allow_abbrev, as vLLM)
            "12",
            "-O3",
            "--compilation-config.cudagraph_capture_sizes+",  # dotted JSON arg with a list
            "1,2",
            "--no-enable-prefix-caching",
        ]
    )
    assert ns.enable_chunked_prefill is True and ns.enable_prefix_caching is False
    assert (ns.max_model_len, ns.gpu_memory_utilization, ns.max_num_batched_tokens, ns.max_num_seqs) == (
        -1,
        0.5,
        4000,
        12,
    )
    assert ns.optimization_level == "3"
    assert ns.compilation_config == {"cudagraph_capture_sizes": ["1", "2"]}  # validated, as vLLM does
    # Defaults are the snapshot's, not the scenario's: 0.92 and no block size (the engine's 16).
    default = vllm_args.parse_args(["serve", "m"])
    assert default.gpu_memory_utilization == 0.92 and default.block_size is None
    s = load_scenario("llama3-70b-tp4")
    cfg = vllm_args.config_from_args(
        s, vllm_args.parse_args(["serve", "m", "-tp", "4", "--max-model-len", "auto"])
    )
    assert cfg.max_model_len == 8192 and cfg.max_model_len_auto and cfg.block_size == 16


def test_034_flags_resolve_the_extensible_mode_in_this_pod(tmp_path: Path) -> None:
    s = load_scenario("llama3-70b-tp4")
    imex = {IMEX_CHANNELS_GLOB_ENV: str(tmp_path / "channel*")}
    nixl = ["--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}']
    with playing("0.34.0"):

        def config(*flags: str) -> EngineConfig:
            return config_from_args(s, parse_args(["serve", "m", "-tp", "4", *flags]), imex)

        assert config().extensible_kv_cache and config().gpu_memory_utilization == 1.0
        assert not config("--kv-cache-memory-bytes", "20G").extensible_kv_cache
        assert not config("--no-enable-extensible-kv-cache").extensible_kv_cache
        off = config(*nixl)  # NIXL exports FABRIC handles: no IMEX channel here
        assert not off.extensible_kv_cache and off.gpu_memory_utilization == 0.92
        (tmp_path / "channel0").touch()
        assert config(*nixl).extensible_kv_cache
        with pytest.raises(EngineConfigError, match="num_gpu_blocks_override overrides"):
            config("--enable-extensible-kv-cache", "--num-gpu-blocks-override", "100")
    # the default release has no such flag, and no such mode
    with pytest.raises(SystemExit):
        parse_args(["serve", "m", "--enable-extensible-kv-cache"])
    assert not config_from_args(s, parse_args(["serve", "m", "-tp", "4"]), imex).extensible_kv_cache
