"""vLLM's argparse `type` callables for the fake `vllm serve`, from cli.json's type descriptions.

Each recorded type name (`int`, `human_readable_int`, `optional`, `lower`, a `parse_dataclass`
JSON option, ...) becomes the converter vLLM's own parser would run, raising argparse's
ArgumentTypeError (exit 2) where vLLM's does. Kept apart from the parser (args.py) because
these are vLLM's value semantics, the parser is its option table and argv preprocessing.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

import jsonschema

from rankguard_sim.vllm_snapshot import snapshot

Converter = Callable[[str], Any]


# ---------------------------------------------------------------------------------------------
# Type conversions: vllm/utils/argparse_utils.py and vllm/engine/arg_utils.py semantics


def human_readable_int(value: str) -> int:
    """vLLM's human_readable_int: 1k = 1000, 1K = 1024 (m/M, g/G, t/T); 25.6k; plain integers.

    Decimals with a binary suffix are refused (argparse.ArgumentTypeError), as vLLM does.
    """
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
        binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        if suffix in decimal:
            return int(float(number) * decimal[suffix])
        try:
            return int(number) * binary[suffix]
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}"
            ) from e
    return int(value)


def human_readable_int_or_auto(value: str) -> int:
    """human_readable_int, plus `-1` or `auto` (any case) meaning -1: fit to the KV memory."""
    value = value.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    return human_readable_int(value)


def _parse_type(convert: Converter) -> Converter:
    """vLLM's parse_type: a ValueError becomes argparse's ArgumentTypeError (exit 2)."""

    def parse(val: str) -> Any:
        try:
            return convert(val)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"Value {val} cannot be converted to {convert}.") from e

    return parse


def _optional_type(convert: Converter) -> Converter:
    """vLLM's optional_type: "" and "None" are None, anything else converts."""

    def parse(val: str) -> Any:
        if val in {"", "None"}:
            return None
        return _parse_type(convert)(val)

    return parse


def _opaque(val: str) -> str:
    return val


_HUMAN_NUMBER = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")


def _expand_human_numbers(val: str) -> str:
    """vLLM's `_expand_json_human_readable_numbers`: `4k` -> `4000` outside JSON strings."""
    parts = re.split(r'("(?:[^"\\]|\\.)*")', val)
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(_HUMAN_NUMBER, lambda m: str(human_readable_int(m.group())), parts[i])
    return "".join(parts)


_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")


@cache
def _lax_validator() -> Any:
    """Draft 2020-12 with pydantic's lax JSON numbers: "3" is an integer (`-cc.cudagraph_capture_sizes+
    1,2` is a list of strings to vLLM's parser, and it starts). One class for every option."""
    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {
            "integer": lambda c, v: (
                (isinstance(v, int) and not isinstance(v, bool))
                or (isinstance(v, float) and v.is_integer())
                or (isinstance(v, str) and _INTEGER.fullmatch(v) is not None)
            ),
            "number": lambda c, v: (
                (isinstance(v, (int, float)) and not isinstance(v, bool))
                or (isinstance(v, str) and _NUMBER.fullmatch(v) is not None)
            ),
        }
    )
    return jsonschema.validators.extend(  # type: ignore[no-untyped-call]  # untyped in its stubs
        jsonschema.Draft202012Validator, type_checker=checker
    )


def _dataclass_type(dest: str) -> Converter:
    """vLLM's `parse_dataclass` for one option: the JSON must validate into the option's pydantic
    dataclass, here its recorded JSON schema (surface.json) checked by jsonschema, made as lax
    as pydantic's JSON mode about numbers."""
    lax = _lax_validator()
    entry = snapshot().surface["json_options"][dest]
    schema = entry.get("schema")
    fields = set(entry.get("fields") or ())

    def parse(val: str) -> Any:
        try:
            value = json.loads(_expand_human_numbers(val))
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{val!r} is not JSON: {e}") from e
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{val!r} is not a JSON object")
        # An Enum field vLLM also takes by member name (surface.json's `x-names`): a name passes,
        # another string fails vLLM's by-name lookup (a KeyError: a traceback, not exit 2)
        props = (schema or {}).get("properties", {})
        checked = dict(value)
        for k, v in value.items():
            names = props.get(k, {}).get("x-names")
            if names and isinstance(v, str):
                if v not in names:
                    raise KeyError(v)
                del checked[k]
        if schema is None:
            unknown = sorted(set(value) - fields)
            if unknown:
                raise argparse.ArgumentTypeError(f"unexpected keyword argument {unknown[0]!r}")
            return value
        try:
            lax(schema).validate(checked)
        except jsonschema.ValidationError as e:
            raise argparse.ArgumentTypeError(f"1 validation error: {e.message}") from e
        # a field that needs another, which the schema cannot say (surface.json's `x-requires`:
        # KVTransferConfig's kv_connector needs a kv_role); vLLM's validator raises, exit 2. The
        # snapshot found it with a non-empty text ("x"): an empty one is unset to vLLM
        for key, needs in schema.get("x-requires", {}).items():
            if value.get(key) and any(value.get(n) is None for n in needs):
                raise argparse.ArgumentTypeError(f"1 validation error: {key} needs {', '.join(needs)}")
        return value

    return parse


_PLAIN_TYPES: dict[str, Converter] = {
    "str": str,
    "int": int,
    "float": float,
    "human_readable_int": human_readable_int,
    "human_readable_int_or_auto": human_readable_int_or_auto,
    "json": _parse_type(json.loads),
    "opaque": _opaque,
    "lower": str.lower,
}


def converter(type_doc: Mapping[str, Any] | None, dest: str = "") -> Converter | None:
    """The argparse `type` for one cli.json type description (None: no conversion)."""
    if type_doc is None:
        return None
    name = type_doc.get("name")
    if name == "optional":
        inner = converter(type_doc.get("of"), dest) or str
        return _optional_type(inner)
    if name == "opaque" and type_doc.get("callable") == "parse_dataclass":
        return _dataclass_type(dest)
    if name in _PLAIN_TYPES:
        return _PLAIN_TYPES[str(name)]
    raise ValueError(f"cli.json: unknown type {type_doc!r}")
