"""vLLM's command line for the fake `vllm serve`, built from the real parser's snapshot.

Every option of the recorded vLLM (`rankguard_operator/vllm_snapshots/<version>/cli.json`)
is accepted with all its spellings, its nargs and its type conversion, so a command line the
real `vllm serve` accepts parses here too, and one it refuses (unknown flag, bad value) exits
2 with argparse's usage error; where vLLM's parser crashes (a negative decimal item, a missing
`--config` file, an unknown CUDA graph mode by name) the fake raises too. The argv goes through
the same preprocessing as vLLM's `FlexibleArgumentParser` first (`--config FILE`, `_` for `-`
in long names, dotted JSON args, `-O3`, `-O 3`); the value types are arg_types.py's. The fake
then uses the values it models (`config_from_args`) and ignores the rest.
tests/unit/core/engine/test_surface.py holds it against the real parser's verdicts.

Kept apart from the server so that anything holding a rendered `vllm serve ...` argv (the
benchmark, tests) resolves it exactly as the fake vLLM does, without starting a process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any

import yaml

from rankguard_sim.fake_vllm.arg_types import converter, human_readable_int
from rankguard_sim.fake_vllm.sandbox import imex_channel_available
from rankguard_sim.physics.engine_config import EngineConfig, EngineConfigError, engine_config
from rankguard_sim.physics.extensible_kv import ExtensibleFacts, Mode, resolve_mode, transfer_access
from rankguard_sim.physics.scenario_data import Scenario
from rankguard_sim.vllm_snapshot import extensible_facts, snapshot, version

# The release this process plays, as it was when the module was imported (the fake itself asks
# `version()`, which follows vllm_snapshot.play)
VLLM_VERSION = version()

# ---------------------------------------------------------------------------------------------
# The parser


class _Switch(argparse.Action):
    """vLLM's BooleanOptionalAction / EnableDisableAction: True unless a negative spelling."""

    def __init__(
        self, option_strings: Sequence[str], dest: str, negative: Sequence[str] = (), **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.negative = frozenset(negative)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, option_string not in self.negative)


class _ItemsAction(argparse.Action):
    """vLLM's LoRAParserAction (surface.json's `custom_options`): each item `name=path` (no
    comma) or a JSON object of the recorded fields, the required ones present; anything else is
    `parser.error` (exit 2), as vLLM's action does."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str,
        fields: Sequence[str] = (),
        item_needs: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.fields = frozenset(fields)
        self.item_needs = frozenset(item_needs)  # not `required`: argparse's own keyword

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        items = [] if values is None else list(values)
        for item in items:
            if item in (None, "") or ("=" in item and "," not in item):
                continue
            try:
                doc = json.loads(item)
            except json.JSONDecodeError:
                parser.error(f"Invalid JSON format for {option_string}: {item}")
            keys = set(doc) if isinstance(doc, dict) else None
            if keys is None or keys - self.fields or self.item_needs - keys:
                parser.error(f"Invalid fields for {option_string}: {item}")
        setattr(namespace, self.dest, items)


def _default(value: Any) -> Any:
    return argparse.SUPPRESS if value == argparse.SUPPRESS else value


def _add_option(parser: argparse.ArgumentParser, opt: Mapping[str, Any]) -> None:
    strings = list(opt["option_strings"])
    kind = opt["kind"]
    common: dict[str, Any] = {"dest": opt["dest"], "default": _default(opt.get("default"))}
    if kind == "switch":
        parser.add_argument(
            *strings, action=_Switch, negative=opt.get("negative_option_strings", ()), **common
        )
        return
    if kind == "true":
        parser.add_argument(*strings, action="store_true", **common)
        return
    kwargs: dict[str, Any] = dict(common)
    convert = converter(opt.get("type"), opt["dest"])
    if opt["dest"] in snapshot().surface["json_options"] and isinstance(common["default"], str):
        # a dataclass default is recorded as its repr; argparse would run the type on a string
        # default, and the fake reads none of these objects
        kwargs["default"] = None
    if convert is not None:
        kwargs["type"] = convert
    if opt.get("nargs") is not None:
        kwargs["nargs"] = opt["nargs"]
    if opt.get("choices") is not None:
        kwargs["choices"] = list(opt["choices"])
    custom = snapshot().surface.get("custom_options", {}).get(opt["dest"])
    if kind == "append":
        kwargs["action"] = "append"
    elif kind == "custom" and custom is not None:
        kwargs |= {"action": _ItemsAction, "fields": custom["fields"], "item_needs": custom["required"]}
    elif kind not in ("value", "custom"):
        raise ValueError(f"cli.json: option {opt['dest']} has unknown kind {kind!r}")
    parser.add_argument(*strings, **kwargs)


def _cli() -> dict[str, Any]:
    cli: dict[str, Any] = snapshot().cli  # the played release's (vllm_snapshot.play)
    return cli


def build_parser() -> argparse.ArgumentParser:
    """`vllm` with its `serve` subcommand, every option from the snapshot's cli.json."""
    parser, sub = top_parser(required=True)
    add_serve(sub)
    return parser


def top_parser(*, required: bool) -> tuple[argparse.ArgumentParser, Any]:
    """`vllm` itself and its subcommands' action (vLLM's own main takes no subcommand as a
    request for help: `required=False`)."""
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM CLI (simulated by rankguard_sim)")
    parser.add_argument("-v", "--version", action="version", version=version())
    return parser, parser.add_subparsers(dest="subparser", required=required)


def add_serve(sub: Any) -> argparse.ArgumentParser:
    """The `serve` subcommand (on `sub`, an add_subparsers action), every option from cli.json."""
    cli = _cli()
    serve: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="Start the vLLM OpenAI Compatible API server.",
        allow_abbrev=bool(cli.get("allow_abbrev", True)),
    )
    for pos in cli.get("positionals", []):
        serve.add_argument(pos["dest"], nargs=pos.get("nargs"))
    for opt in cli["options"]:
        _add_option(serve, opt)
    return serve


def options() -> list[dict[str, Any]]:
    """The snapshot's `vllm serve` options (cli.json), for tests and tools."""
    return list(_cli()["options"])


# ---------------------------------------------------------------------------------------------
# FlexibleArgumentParser's argv preprocessing


_NAME = re.compile(r"(?<=--)[^.]*")


def _dashes(match: re.Match[str]) -> str:
    return match.group(0).replace("_", "-")


def _nested(keys: list[str], value: Any) -> Any:
    for key in reversed(keys):
        value = {key: value}
    return value


def _merge(original: dict[str, Any], update: Mapping[str, Any]) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(original.get(k), dict):
            _merge(original[k], v)
        elif isinstance(v, list) and isinstance(original.get(k), list):
            original[k] += v
        else:
            original[k] = v


def _pull_config(args: list[str]) -> list[str]:
    """vLLM's `--config FILE`: a YAML mapping spliced in after `serve MODEL` as flags (a file
    that is not .yaml/.yml or cannot be read raises, as vLLM's does: a traceback, exit 1)."""
    at = args.index("--config")
    if at == len(args) - 1:
        raise ValueError("No config file specified! Please check your command-line arguments.")
    path = args[at + 1]
    extension = path.split(".")[-1]
    if extension not in ("yaml", "yml"):
        raise ValueError(f"Config file must be of a yaml/yml type. {extension} supplied")
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    flags: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            flags += [f"--{key}"] if value else []
        elif isinstance(value, list):
            flags += [f"--{key}", *map(str, value)] if value else []
        elif isinstance(value, dict):
            flags += [f"--{key}", json.dumps(value)]
        else:
            flags += [f"--{key}", str(value)]
    return [*args[:2], *flags, *args[2:at], *args[at + 2 :]]


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """What vLLM's FlexibleArgumentParser.parse_args does to argv before argparse sees it.

    `--model X` moves to the positional; `_` becomes `-` in a long option's name (up to the
    first `.`); `-O3`, `-O=3` and `-O 3` become `--optimization-level 3`; dotted JSON
    arguments (`--json-arg.key value`, `--json-arg.key+ a,b`) are merged into one JSON value
    per argument, appended at the end as vLLM does.
    """
    args = list(argv)
    if args and args[0] == "serve":
        for i, arg in enumerate(args):
            if re.match(r"^--model(=.+|$)", arg):
                if arg == "--model" and i + 1 < len(args):
                    tag, rest = args[i + 1], i + 2
                else:
                    tag, rest = arg.removeprefix("--model="), i + 1
                args = ["serve", tag, *args[1:i], *args[rest:]]
                break
    if "--config" in args:
        args = _pull_config(args)
    processed: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            if "=" in arg:
                name, text = arg.split("=", 1)
                processed.append(f"{_NAME.sub(_dashes, name, count=1)}={text}")
            else:
                processed.append(_NAME.sub(_dashes, arg, count=1))
        elif arg.startswith("-O") and arg != "-O":
            processed += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            processed.append("--optimization-level")
        else:
            processed.append(arg)

    delete: set[int] = set()
    dict_args: defaultdict[str, dict[str, Any]] = defaultdict(dict)
    for i, token in enumerate(processed):
        if i in delete:
            continue
        if token.startswith("--") and "." not in token:
            continue
        if token.startswith("-") and "." in token:
            arg = token
            if "=" in arg:
                arg, value_str = arg.split("=", 1)
                if "." not in arg:
                    continue  # the '.' was only in the value
            else:
                # as vLLM: the next item is the value, and with none the parser crashes
                # (IndexError): `--seed -0.5` as the last items, since `-0.5` holds a '.'
                value_str = processed[i + 1]
                delete.add(i + 1)
            if arg.endswith("+"):
                arg = arg[:-1]
                value_str = json.dumps(value_str.split(","))
            key, *keys = arg.split(".")
            parsed: Any
            try:
                parsed = json.loads(value_str)
            except json.JSONDecodeError:
                try:
                    parsed = human_readable_int(value_str)
                except (ValueError, argparse.ArgumentTypeError):
                    parsed = value_str
            _merge(dict_args[key], _nested(keys, parsed))
            delete.add(i)
    out = [a for i, a in enumerate(processed) if i not in delete]
    for name, merged in dict_args.items():
        out += [name, json.dumps(merged)]
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse like vLLM: argparse's own errors (unknown flag, bad value) exit with status 2."""
    return build_parser().parse_args(normalize_argv(argv))


@cache
def _defaults(release: str) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(vars(build_parser().parse_args(["serve"])).items()))


def non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    """What vLLM logs as `non-default args`: every value that differs from its default."""
    defaults = dict(_defaults(version()))
    out = {"model_tag": args.model_tag} if args.model_tag is not None else {}
    for key, value in vars(args).items():
        if key in ("subparser", "model_tag") or key not in defaults:
            continue
        if value != defaults[key]:
            out[key] = value
    return out


def config_from_args(
    scenario: Scenario, args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> EngineConfig:
    """The EngineConfig parsed flags give on this scenario (raises EngineConfigError as vLLM refuses).

    Only the flags the simulated world models are read; every other option the real vLLM
    accepts is parsed and ignored. `env` is read for VLLM_ALLOW_LONG_MAX_MODEL_LEN and the IMEX glob;
    None means this process's environment, which is what the fake vLLM uses.
    """
    env = os.environ if env is None else env
    return engine_config(
        scenario,
        extensible_kv_cache=extensible_mode(args, env).enabled,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=bool(args.enforce_eager),
        disable_custom_all_reduce=bool(args.disable_custom_all_reduce),
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        allow_long_max_model_len=env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "") in ("1", "true", "True"),
    )


def extensible_mode(args: argparse.Namespace, env: Mapping[str, str]) -> Mode:
    """vLLM 0.34's `_resolve_extensible_kv_cache` for these flags in this pod (off on a release
    without the mode); raises EngineConfigError with vLLM's refusal."""
    facts = extensible_facts()
    if facts is None:
        return Mode(False, "release")
    known = ExtensibleFacts.from_engine(facts)
    transfer = getattr(args, "kv_transfer_config", None)
    access, pool = transfer_access(known, transfer if isinstance(transfer, dict) else None)
    mode = resolve_mode(
        known,
        requested=getattr(args, "enable_extensible_kv_cache", None),
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=getattr(args, "num_gpu_blocks_override", None),
        access=access,
        custom_mem_pool=pool,
        imex_channel=imex_channel_available(env),
    )
    if mode.error is not None:
        raise EngineConfigError(mode.error)
    return mode


def engine_config_from_argv(
    scenario: Scenario, argv: Sequence[str], env: Mapping[str, str] | None = None
) -> EngineConfig:
    """The EngineConfig a `vllm serve ...` argv (without the `vllm` itself) gives on this scenario.

    The same parse and resolution the fake vLLM runs: a bad command line exits 2 (SystemExit,
    as argparse does) and flags vLLM would refuse raise EngineConfigError. `parse_args(argv)`
    gives the namespace alone.
    """
    return config_from_args(scenario, parse_args(argv), env)
