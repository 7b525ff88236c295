"""What vLLM checks when it builds its engine config, held at apply time.

engine/arg_utils.py create_engine_config, config/vllm.py, config/speculative.py,
config/kv_transfer.py: read from the objects the JSON options hold once vLLM has folded them
(VllmCli.json_object), with the bounds, names and keys the snapshot recorded (surface.json:
value_bounds, names, dict_options). tests/fixtures/vllm_argv_cases*.json's `config` verdicts
are what these answer to (tests/unit/core/engine/test_surface.py). Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence

from rankguard_operator.core.engine.settings import Setting, int_value, turned_on
from rankguard_operator.core.engine.vllm_cli import VllmCli
from rankguard_operator.vllm_snapshots import version_key


def config_problems(extra_args: Sequence[str], cli: VllmCli, found: Mapping[str, Setting]) -> list[str]:
    problems = _object_defaults_problems(found)
    problems += _mamba_problems(found)
    problems += _value_shape_problems(found)
    problems += [p for p in (_mm_loras_problem(found),) if p is not None]
    problems += _lora_modules_problems(extra_args, cli, found)
    problems += _capture_problems(extra_args, cli, found)
    problems += _bounds_problems(cli, found)
    problems += _value_needs_problems(cli, found)
    problems += _names_problems(cli, found)
    problems += _dict_keys_problems(extra_args, cli, found)
    problems += _speculative_problems(extra_args, cli, found)
    problems += _kv_transfer_problems(extra_args, cli, found)
    return problems


# Options whose config field is a dict while the parser takes any text or JSON: `0`, `false` or
# a list parses, and vLLM refuses it when it builds the config (or, --reasoning-effort-map, in its
# serve-args validation). `--model-loader-extra-config` is read only when the weights load.
OBJECT_VALUED = frozenset(
    {
        "additional_config",
        "hf_overrides",
        "limit_mm_per_prompt",
        "media_io_kwargs",
        "model_class_overrides",
        "override_generation_config",
        "custom_histogram_buckets",
        "diffusion_config",
        "mm_processor_kwargs",
        "watermark_config",
        "reasoning_effort_map",
    }
)

# dest -> (the option it needs, the values of it that vLLM's config build takes with it): a
# switch vLLM refuses at config build unless another option holds one of these (config/vllm.py:
# sampling replay needs processed logprobs; micro-batching (DBO) on CUDA needs an all-to-all
# backend that can split a batch). Only the values the release's own choices hold count, so a
# release that renames them drops the rule rather than refuse what it runs.
_VALUE_NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "return_sampling_mask": ("logprobs_mode", ("processed_logprobs",)),
    "enable_dbo": ("all2all_backend", ("deepep_low_latency", "deepep_high_throughput", "nixl_ep")),
}


# The release that added the sampling-replay check (config/vllm.py `_verify_sampling_mask_config`):
# 0.33 runs `--return-sampling-mask` with any logprobs mode
_SAMPLING_MASK_CHECKED = (0, 34, 0)


def _value_needs_problems(cli: VllmCli, found: Mapping[str, Setting]) -> list[str]:
    problems = []
    if (version_key(cli.version) or (0, 0, 0)) < _SAMPLING_MASK_CHECKED:
        found = {d: s for d, s in found.items() if d != "return_sampling_mask"}
    for dest, (needs, values) in _VALUE_NEEDS.items():
        s = found.get(dest)
        option = cli.option(needs)
        if s is None or not turned_on(s) or option is None:
            continue
        takes = [v for v in values if v in (option.choices or ())]
        need = found.get(needs)
        given = need.value if need is not None and need.value is not None else option.default
        if takes and given not in takes:
            problems.append(
                f"[{s.at}] {s.key} needs {option.name} {' or '.join(takes)} (vLLM refuses it with "
                f"{given} when it builds the config)"
            )
    return problems


# dest -> (what vLLM's config takes, the test): values its parser passes as text and its config
# refuses
_VALUE_SHAPES: dict[str, tuple[str, Callable[[str], bool]]] = {
    "optimization_level": ("0, 1, 2 or 3", lambda v: v.strip() in ("0", "1", "2", "3")),
    "device_ids": (
        "integer device IDs",
        lambda v: all(p.strip().lstrip("-").isdigit() for p in v.split(",")),
    ),
    # numactl's lists, one per GPU: `0-3,8-11` (CPUs), `0` (nodes)
    "numa_bind_cpus": (
        "numactl CPU lists",
        lambda v: re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", v.strip()) is not None,
    ),
    "numa_bind_nodes": ("non-negative NUMA node numbers", lambda v: v.strip().isdigit()),
    "show_hidden_metrics_for_version": (
        "a release such as 0.32",
        lambda v: re.fullmatch(r"\d+(\.\d+)*", v.strip()) is not None,
    ),
}


def _value_shape_problems(found: Mapping[str, Setting]) -> list[str]:
    problems = []
    for dest, (what, fits) in _VALUE_SHAPES.items():
        s = found.get(dest)
        if s is not None and s.value is not None and turned_on(s) and not fits(s.value):
            problems.append(f"[{s.at}] {s.key} takes {what}, got {s.value!r} (vLLM refuses it)")
    return problems


def _mamba_problems(found: Mapping[str, Setting]) -> list[str]:
    """config/mamba.py: an SSU algorithm only with the FlashInfer backend; stochastic rounding only
    with a float16 SSM cache."""
    problems = []
    algorithm = found.get("mamba_ssu_algorithm")
    backend = found.get("mamba_backend")
    flashinfer = backend is not None and (backend.value or "").lower() == "flashinfer"
    if algorithm is not None and turned_on(algorithm) and not flashinfer:
        problems.append(f"[{algorithm.at}] {algorithm.key} needs --mamba-backend flashinfer (vLLM)")
    rounding = found.get("enable_mamba_cache_stochastic_rounding")
    dtype = found.get("mamba_ssm_cache_dtype")
    if rounding is not None and turned_on(rounding) and (dtype is None or dtype.value != "float16"):
        problems.append(f"[{rounding.at}] {rounding.key} needs --mamba-ssm-cache-dtype float16 (vLLM)")
    return problems


def _lora_modules_problems(
    extra_args: Sequence[str], cli: VllmCli, found: Mapping[str, Setting]
) -> list[str]:
    """vLLM's LoRA module reader: each item is `name=path` or a JSON object with name and path."""
    s = found.get("lora_modules")
    if s is None:
        return []
    for item in _values(extra_args, cli, "lora_modules"):
        if "=" in item and not item.lstrip().startswith("{"):
            continue
        try:
            value = json.loads(item)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            return [
                f"[{s.at}] {s.key} takes name=path or a JSON object per adapter, got {item[:60]!r} (vLLM)"
            ]
    return []


def _mm_loras_problem(found: Mapping[str, Setting]) -> str | None:
    """`--default-mm-loras`: a modality -> adapter object; vLLM treats a falsy JSON value (`0`,
    `false`) as unset and refuses any other non-object when it builds the config."""
    s = found.get("default_mm_loras")
    if s is None or not s.on or s.value is None:
        return None
    try:
        value = json.loads(s.value)
    except ValueError:
        return None  # not JSON: the reader refuses it
    if value and not isinstance(value, dict):
        return f"[{s.at}] {s.key} takes a JSON object (modality -> LoRA path), got {s.value!r} (vLLM)"
    return None


def _object_defaults_problems(found: Mapping[str, Setting]) -> list[str]:
    """An OBJECT_VALUED option given something other than a JSON object (an optional one's `None`
    is unset to vLLM)."""
    problems = []
    for dest, s in found.items():
        o = s.option
        if o is None or dest not in OBJECT_VALUED or s.value is None or not turned_on(s):
            continue
        try:
            value = json.loads(s.value)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            problems.append(
                f'[{s.at}] {s.key} needs a JSON object ({{"key": value}}), got {s.value[:60]!r}: vLLM\'s '
                "config refuses anything else when it builds the engine config"
            )
    return problems


def _capture_problems(extra_args: Sequence[str], cli: VllmCli, found: Mapping[str, Setting]) -> list[str]:
    """CUDA-graph capture sizes: `--cudagraph-capture-sizes` and the compilation config's list are
    mutually exclusive, a list must hold a size, and a max_cudagraph_capture_size next to a list
    must be its largest size (vLLM's _set_cudagraph_sizes)."""
    cc = cli.json_object(extra_args, "compilation_config") or {}
    flag = found.get("cudagraph_capture_sizes")
    flag_sizes = _ints(_values(extra_args, cli, "cudagraph_capture_sizes"))
    cc_sizes = cc.get("cudagraph_capture_sizes")
    where = flag or found.get("compilation_config")
    if where is None:
        return []
    at = f"[{where.at}] {where.key}"
    if flag is not None and cc_sizes is not None:
        return [
            f"{at}: --cudagraph-capture-sizes and the compilation config's cudagraph_capture_sizes are "
            "mutually exclusive (vLLM refuses both); give the sizes once"
        ]
    sizes = flag_sizes if flag is not None else _ints(cc_sizes) if isinstance(cc_sizes, list) else None
    if sizes is not None and not sizes and isinstance(cc_sizes, list):
        return [f"{at}: cudagraph_capture_sizes is empty; vLLM needs a size to capture CUDA graphs"]
    top = cc.get("max_cudagraph_capture_size")
    if (
        sizes
        and isinstance(top, (int, float, str))
        and int_value(str(top)) is not None
        and int_value(str(top)) != max(sizes)
    ):
        return [
            f"{at}: the compilation config's max_cudagraph_capture_size ({top}) must be the largest of the "
            f"capture sizes ({max(sizes)}), as vLLM requires when both are given; drop it or make them agree"
        ]
    return []


def _values(extra_args: Sequence[str], cli: VllmCli, dest: str) -> list[str]:
    """The values the last item of `dest` took (a list option's items)."""
    values: list[str] = []
    for _, word in cli.walk(extra_args)[0]:
        if word.option is not None and word.option.dest == dest:
            values = list(word.values)
    return values


def _ints(items: Sequence[object]) -> list[int]:
    out = []
    for item in items:
        n = int_value(str(item)) if not isinstance(item, bool) else None
        if n is not None:
            out.append(n)
    return out


_BOUND_WORDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _out_of_bounds(bounds: Mapping[str, float], v: float) -> str | None:
    tests = {"ge": v >= bounds.get("ge", v), "gt": "gt" not in bounds or v > bounds["gt"]}
    tests |= {"le": v <= bounds.get("le", v), "lt": "lt" not in bounds or v < bounds["lt"]}
    failed = [k for k in ("ge", "gt", "le", "lt") if k in bounds and not tests[k]]
    return None if not failed else f"{_BOUND_WORDS[failed[0]]} {bounds[failed[0]]:g}"


# Config classes vLLM builds only when something asks for them, so their bounds hold only then:
# LoRAConfig with --enable-lora (class -> the switch); MultiModalConfig only for a multimodal
# model, which the apply-time rules cannot see (the pod's own vLLM judges those).
_BUILT_WITH = {"LoRAConfig": "enable_lora"}
_BUILT_FOR_SOME_MODELS = frozenset({"MultiModalConfig"})


def _bounds_problems(cli: VllmCli, found: Mapping[str, Setting]) -> list[str]:
    """A number out of the bounds its config field carries (surface.json's `value_bounds`, read
    from the field's `Field(ge=...)`): vLLM's pydantic config refuses it when it builds the engine
    config (`--dp-sync-interval 0`: "Input should be greater than or equal to 1")."""
    problems = []
    for dest, s in found.items():
        entry = cli.value_bounds.get(dest)
        if entry is None or not s.on or s.value is None or s.option is None:
            continue
        cls = str(entry["field"]).split(".")[0]
        switch = found.get(_BUILT_WITH.get(cls, ""))
        if cls in _BUILT_FOR_SOME_MODELS or (
            cls in _BUILT_WITH and (switch is None or not turned_on(switch))
        ):
            continue
        try:
            value = s.option.reads(s.value)
        except ValueError:
            continue  # a value vLLM's parser refuses: the reader says so
        items = value if isinstance(value, list) else [value]
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            need = _out_of_bounds(entry["bounds"], v)
            if need is not None:
                problems.append(f"[{s.at}] '{s.key} {s.value}': vLLM requires {need} ({entry['field']})")
                break
    return problems


def _names_problems(cli: VllmCli, found: Mapping[str, Setting]) -> list[str]:
    """A name vLLM looks up when it builds the config (`--attention-backend`, `--mamba-backend`,
    `--config-format`: surface.json's `value_names`), folded as vLLM folds it, that it lacks."""
    problems = []
    for dest, entry in cli.value_names.items():
        s = found.get(dest)
        if s is None or not s.on or s.value is None or s.option is None:
            continue
        try:
            if s.option.reads(s.value) is None:
                continue  # null to vLLM's parser: not set
        except ValueError:
            continue
        text = s.value.upper() if entry.get("fold") == "upper" else s.value
        if text not in entry["names"]:
            problems.append(
                f"[{s.at}] '{s.key} {s.value}': vLLM {cli.version} has no such name (it takes: "
                f"{', '.join(entry['names'])})"
            )
    return problems


def _dict_keys_problems(extra_args: Sequence[str], cli: VllmCli, found: Mapping[str, Setting]) -> list[str]:
    """The JSON options vLLM hands to a config class as keyword arguments (surface.json's
    `dict_options`: `SpeculativeConfig(**d)`): a key the class lacks, or a field without a
    default left out, and vLLM refuses the config."""
    problems = []
    for dest, entry in cli.dict_options.items():
        s = found.get(dest)
        doc = cli.json_object(extra_args, dest)
        if s is None or doc is None:
            continue
        keys = {str(k).replace("-", "_") for k in doc}  # arg_utils folds `-` to `_` in these keys
        unknown = sorted(keys - set(entry["fields"]))
        missing = sorted(set(entry["required"]) - keys)
        if unknown:
            problems.append(
                f"[{s.at}] {s.key}: vLLM {cli.version}'s {entry['class'].rsplit('.', 1)[-1]} has no "
                f"{', '.join(unknown)} (it takes: {', '.join(entry['fields'])})"
            )
        elif missing:
            problems.append(
                f"[{s.at}] {s.key}: vLLM {cli.version}'s {entry['class'].rsplit('.', 1)[-1]} needs "
                f"{', '.join(missing)}"
            )
    return problems


# vLLM's own flags that fill the speculative config (arg_utils: --spec-method and friends)
_SPEC_FLAGS = (("spec_method", "method"), ("spec_model", "model"), ("spec_tokens", "num_speculative_tokens"))


def _speculative_problems(extra_args: Sequence[str], cli: VllmCli, found: Mapping[str, Setting]) -> list[str]:
    """SpeculativeConfig's own checks: a draft model or a method with its number of tokens (a
    draft model's config may carry n_predict, which vLLM reads in the pod), and more than 0."""
    given = cli.json_object(extra_args, "speculative_config")  # `0`, `false`: no speculation to vLLM
    doc = dict(given or {})
    where = found.get("speculative_config") if given is not None else None
    for dest, key in _SPEC_FLAGS:
        s = found.get(dest)
        if s is not None and s.value not in (None, "", "None"):
            if key in doc:
                return [f"[{s.at}] {s.key} and the speculative config's {key} are mutually exclusive (vLLM)"]
            doc[key] = s.value
            where = where or s
    if where is None:
        return []
    at = f"[{where.at}] {where.key}"
    tokens = doc.get("num_speculative_tokens")
    if tokens is not None and (int_value(str(tokens)) or 0) < 1:
        return [f"{at}: num_speculative_tokens must be greater than 0 (vLLM), got {tokens}"]
    if tokens is not None and doc.get("model") is None and doc.get("method") is None:
        return [f"{at}: num_speculative_tokens needs a draft model or a method (vLLM); add one"]
    if tokens is None and doc.get("model") is None:
        return [
            f"{at}: a speculative config without a draft model needs num_speculative_tokens (vLLM refuses "
            "it otherwise); add num_speculative_tokens"
        ]
    return []


def _kv_transfer_problems(extra_args: Sequence[str], cli: VllmCli, found: Mapping[str, Setting]) -> list[str]:
    """KVTransferConfig's own checks: a connector, its role, and a connector vLLM has (the
    release's recorded list, where the snapshot has one)."""
    where = found.get("kv_transfer_config")
    doc = cli.json_object(extra_args, "kv_transfer_config")
    if where is None or doc is None:
        return []
    if "kv_offloading_size" in found and turned_on(found["kv_offloading_size"]):
        return []  # vLLM sets the offloading connector and its role itself
    at = f"[{where.at}] {where.key}"
    connector = doc.get("kv_connector")
    if not connector:
        return [
            f'{at}: names no kv_connector, which vLLM refuses ("Connector name is not set"); add kv_connector'
        ]
    if doc.get("kv_role") is None:
        return [f"{at}: kv_connector {connector} needs kv_role (kv_producer, kv_consumer, kv_both; vLLM)"]
    known = cli.kv_connectors
    names = [connector]
    if connector == "MultiConnector":
        extra = doc.get("kv_connector_extra_config")
        children = extra.get("connectors") if isinstance(extra, dict) else None
        names += [
            c.get("kv_connector") for c in children or [] if isinstance(c, dict) and c.get("kv_connector")
        ]
    if known and doc.get("kv_connector_module_path") is None:
        unknown = [str(n) for n in names if n not in known]
        if unknown:
            return [
                f"{at}: vLLM {cli.version} has no KV connector {', '.join(unknown)} (it has: "
                f"{', '.join(sorted(known))}); name one of those, or set kv_connector_module_path"
            ]
    return []
