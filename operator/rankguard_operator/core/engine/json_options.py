"""vLLM's JSON options checked as vLLM checks them, before anything is deployed.

About twenty `vllm serve` options (`--compilation-config`, `--kv-transfer-config`,
`--attention-config`, …) take a JSON object that vLLM validates into a pydantic dataclass
(`TypeAdapter(cls).validate_json`, after expanding `4k`-style numbers outside strings). The
snapshot records each dataclass's JSON schema (surface.json, read from the real package);
`check_json_option` walks a value against it: a JSON object, no key the dataclass does not
have (vLLM's config classes forbid extra keys), every value of its field's type, as pydantic's
lax mode reads JSON (`"3"` is an integer: `-cc.cudagraph_capture_sizes+ 1,2` gives strings, and
vLLM starts). Where the check is unsure it refuses rather than accepts (a bool is not an
integer here, `"yes"` is not a boolean): a refused spec names the key and costs a person one
edit, an accepted one that vLLM refuses crash-loops a pod.

Pure: no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_HUMAN_NUMBER = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")
_QUOTED = re.compile(r'("(?:[^"\\]|\\.)*")')


def expand_human_numbers(text: str, to_int: Callable[[str], int]) -> str:
    """`{"max_cudagraph_capture_size": 4k}` -> `{"max_cudagraph_capture_size": 4000}`, outside
    JSON strings only (vLLM's `_expand_json_human_readable_numbers`)."""
    parts = _QUOTED.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = _HUMAN_NUMBER.sub(lambda m: str(to_int(m.group())), parts[i])
    return "".join(parts)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    return "an object"


class _Schema:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self.defs: Mapping[str, Any] = root.get("$defs", {})

    def resolve(self, s: Mapping[str, Any]) -> Mapping[str, Any]:
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return self.resolve(self.defs.get(ref.removeprefix("#/$defs/"), {}))
        return s

    def problem(self, s: Mapping[str, Any], v: Any, at: str) -> str | None:
        """Why `v` does not validate against `s` (None: it does)."""
        if isinstance(v, str) and v in s.get("x-names", ()):
            return None  # an Enum field vLLM also takes by member name
        s = self.resolve(s)
        for key in ("anyOf", "oneOf"):
            if key in s:
                whys = [self.problem(sub, v, at) for sub in s[key]]
                if all(w is not None for w in whys):
                    return next(w for w in whys if w is not None) if len(whys) == 1 else _any_of(whys, at, v)
                return None
        for sub in s.get("allOf", []):
            why = self.problem(sub, v, at)
            if why is not None:
                return why
        if "const" in s and v != s["const"]:
            return f"{at} must be {json.dumps(s['const'])}, got {json.dumps(v)}"
        if "enum" in s and v not in s["enum"]:
            shown = ", ".join(json.dumps(e) for e in s["enum"])
            return f"{at} must be one of {shown}; got {json.dumps(v)}"
        t = s.get("type")
        types: list[str] = [str(k) for k in t] if isinstance(t, list) else [str(t)] if t is not None else []
        if types and not any(_is(kind, v) for kind in types):
            return f"{at} must be {' or '.join(_TYPE_WORDS.get(k, k) for k in types)}, got {_kind(v)}"
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            why = _out_of_range(s, v)
            if why is not None:
                return f"{at} is {v}, out of range ({why})"
        if isinstance(v, list):
            return self._list(s, v, at)
        if isinstance(v, dict):
            return self._object(s, v, at)
        return None

    def _list(self, s: Mapping[str, Any], v: list[Any], at: str) -> str | None:
        if "minItems" in s and len(v) < s["minItems"]:
            return f"{at} needs at least {s['minItems']} items"
        if "maxItems" in s and len(v) > s["maxItems"]:
            return f"{at} takes at most {s['maxItems']} items"
        prefix = s.get("prefixItems") or []
        for i, item in enumerate(v):
            sub = prefix[i] if i < len(prefix) else s.get("items")
            if isinstance(sub, Mapping):
                why = self.problem(sub, item, f"{at}[{i}]")
                if why is not None:
                    return why
        return None

    def _object(self, s: Mapping[str, Any], v: dict[str, Any], at: str) -> str | None:
        props: Mapping[str, Any] = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for key, value in v.items():
            where = f"{at}.{key}"
            if key in props:
                why = self.problem(props[key], value, where)
            elif extra is False:
                known = ", ".join(sorted(props)) or "none"
                return f"{where} is not a key vLLM knows here (accepted keys: {known})"
            elif isinstance(extra, Mapping):
                why = self.problem(extra, value, where)
            else:
                why = None
            if why is not None:
                return why
        missing = [k for k in s.get("required", []) if k not in v]
        if missing:
            return f"{at} needs {', '.join(missing)}"
        return None


def _out_of_range(s: Mapping[str, Any], v: float) -> str | None:
    checks: tuple[tuple[str, Callable[[float], bool]], ...] = (
        ("minimum", lambda lim: v >= lim),
        ("maximum", lambda lim: v <= lim),
        ("exclusiveMinimum", lambda lim: v > lim),
        ("exclusiveMaximum", lambda lim: v < lim),
    )
    for key, inside in checks:
        limit = s.get(key)
        if isinstance(limit, (int, float)) and not inside(limit):
            return f"{key} {limit}"
    return None


def _any_of(whys: list[str | None], at: str, v: Any) -> str:
    # Several alternatives all failed: say the value's kind did not fit; the first reason that
    # names a deeper key is more useful than a list of every alternative.
    deeper = [w for w in whys if w is not None and not w.startswith(f"{at} must be")]
    return deeper[0] if deeper else f"{at} does not accept {_kind(v)} {json.dumps(v)[:60]}"


_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "array": "a list",
    "object": "an object",
    "null": "null",
}


def _is(kind: str, v: Any) -> bool:
    if kind == "null":
        return v is None
    if kind == "boolean":
        return isinstance(v, bool)
    if kind == "integer":
        return (
            (isinstance(v, int) and not isinstance(v, bool))
            or (isinstance(v, float) and v.is_integer())
            or (isinstance(v, str) and _INTEGER.fullmatch(v) is not None)
        )
    if kind == "number":
        return (isinstance(v, (int, float)) and not isinstance(v, bool)) or (
            isinstance(v, str) and _NUMBER.fullmatch(v) is not None
        )
    if kind == "string":
        return isinstance(v, str)
    if kind == "array":
        return isinstance(v, list)
    if kind == "object":
        return isinstance(v, dict)
    return True  # a kind this checker does not know: vLLM judges it


def check_json_option(entry: Mapping[str, Any], text: str, to_int: Callable[[str], int]) -> str | None:
    """Why vLLM would refuse `text` for one JSON option (surface.json's entry), or None.

    The sentence starts with the path of the bad key (`$.level`), for the caller to prefix
    with the flag."""
    try:
        value = json.loads(expand_human_numbers(text, to_int))
    except ValueError:
        return f"needs a JSON object, got {text[:60]!r} (not JSON)"
    if not isinstance(value, dict):
        return f"needs a JSON object, got {_kind(value)}"
    schema = entry.get("schema")
    if isinstance(schema, Mapping):
        why = _Schema(schema).problem(schema, value, "$")
        # a field that needs another, which a JSON schema cannot say (surface.json's `x-requires`,
        # found through vLLM's own validator: a non-empty kv_connector needs a kv_role)
        for key, needs in (schema.get("x-requires") or {}).items():
            missing = [n for n in needs if value.get(n) is None]
            if why is None and value.get(key) and missing:
                why = f"$.{key} needs {missing[0]} too (vLLM refuses it without)"
        return why
    fields = entry.get("fields") or []
    unknown = sorted(set(value) - set(fields))
    if unknown:
        return f"$.{unknown[0]} is not a key vLLM knows here (accepted keys: {', '.join(fields)})"
    return None
