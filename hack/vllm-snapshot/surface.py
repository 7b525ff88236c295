"""What the real `vllm serve` checks beyond argparse's types, read out of the installed package.

Imported by snapshot.py (runs INSIDE the venv with the real vLLM). (Over 450 lines because it is
one record, surface.json: each function below reads one of its keys out of the package, and they
share the readers of vLLM's parser actions and config dataclasses.) Writes `surface.json`:

- `help_options`: the help action's spellings. They are not options a service can use, but
  they count for prefix matching (`--he` is ambiguous between `--help` and `--headless`).
- `json_options`: every option whose value vLLM parses as a pydantic dataclass
  (`parse_dataclass` in vllm/engine/arg_utils.py: `TypeAdapter(cls).validate_json`), with the
  dataclass's JSON schema (titles, descriptions and defaults stripped: only what validates),
  or, where pydantic cannot write a schema, the field names alone. An Enum field that vLLM
  also takes by member name carries the names that validate (`x-names`).
- `attention_block_sizes`: for each attention backend vLLM's CUDA platform tries for
  non-MLA models (`_get_backend_priorities`), the block sizes from a candidate list its own
  `supports_block_size` accepts. The CPU build (cpu_build.py) lacks some of their modules: there
  the ones that import are recorded, the others in `attention_backends_absent` with the import
  error, and the CPU platform's own backend in `cpu_attention`.
- `world_size`: the ParallelConfig fields whose product is vLLM's world size (read from the
  assignment in `ParallelConfig.__post_init__`), with the source line.
- `endpoint_dests`: the options the serve command and the API server's socket setup read to
  decide what listens where (`ServeSubcommand.cmd`, `setup_server`, and `build_and_serve`'s
  `serve_http(...)` call; `args.X` and `getattr(args, "X", ...)` alike), with the function each was read in.
- `memory_dests`: the options that size GPU or host memory by name (`*_gb`, `*_bytes`,
  `*_size` of an offload, memory utilisation): the ones the operator must plan, own or refuse.
- `value_bounds`: serve option dest -> the bounds (`ge`/`gt`/`le`/`lt`) its config field carries
  (`Field(ge=1)`, annotated_types metadata), which vLLM's pydantic config enforces when it builds
  the engine config (`--dp-sync-interval 0`: "Input should be greater than or equal to 1"). The
  field is the one EngineArgs' own default names (`x: int = SchedulerConfig.x`,
  `get_field(CacheConfig, "x")`), else the config fields of that name, when they all agree.
- `value_names`: the names vLLM accepts for options its parser takes as any text and its config
  build looks up (`--attention-backend`, `--mamba-backend`, `--config-format`), each tried through
  vLLM's own lookup, with `fold` "upper" where vLLM upper-cases the text first.
- `kv_connectors`: the KV connector names vLLM's factory registers (KVConnectorFactory).
- `dict_options`: the JSON options vLLM's parser takes as any JSON and hands to a config class as
  keyword arguments (`SpeculativeConfig(**d)`, `WatermarkConfig(**d)`): the class's field names
  and the ones without a default (`required`).
- `custom_options`: options whose parser action is vLLM's own (not argparse's), with what it
  takes: `--lora-modules`' LoRAParserAction reads each item as `name=path` (no comma) or a JSON
  object of LoRAModulePath's fields, and exits 2 (`parser.error`) on anything else.
- A JSON option's `x-requires` (in `json_options`' schema): a field that, when set, needs another
  one its schema cannot say (KVTransferConfig: a kv_connector needs a kv_role), found by
  validating `{field: "x"}` through the real TypeAdapter, alone and beside each enum field.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

# Block sizes tried against each backend's own `supports_block_size` (powers of two and the
# odd multiples users try); the snapshot records which pass.
CANDIDATE_BLOCK_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# JSON-schema keys that validate; the rest (title, description, default, examples) do not.
SCHEMA_KEYS = {
    "type",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "properties",
    "additionalProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "required",
}
MEMORY_NAME = re.compile(r"(_gb$|_bytes$|memory|offload)")


def _strip(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k in ("properties", "$defs"):
                out[k] = {name: _strip(s) for name, s in v.items()}
            elif k in SCHEMA_KEYS:
                out[k] = _strip(v)
        return out
    if isinstance(schema, list):
        return [_strip(s) for s in schema]
    return schema


def _dataclass_of(action: Any) -> Any:
    """The dataclass a `parse_dataclass` type validates into (also under `optional_type`)."""
    t = action.type
    for _ in range(2):
        if t is None or not hasattr(t, "__code__"):
            return None
        if t.__name__ == "parse_dataclass":
            return (t.__defaults__ or (None,))[0]
        cells = dict(zip(t.__code__.co_freevars, t.__closure__ or (), strict=True))
        if "return_type" not in cells:
            return None
        t = cells["return_type"].cell_contents
    return None


def _enums_in(annotation: Any) -> list[Any]:
    import enum
    import typing

    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [annotation]
    return [e for arg in typing.get_args(annotation) for e in _enums_in(arg)]


def _add_enum_names(cls: Any, schema: dict[str, Any]) -> None:
    """A field typed by an Enum whose schema lists the values, but which vLLM also takes by
    member name (a before-validator: `"cudagraph_mode": "FULL_AND_PIECEWISE"`): the names that
    validate are recorded on the field as `x-names`, each tried through the real TypeAdapter."""
    import typing

    from pydantic import TypeAdapter

    hints = typing.get_type_hints(cls)
    adapter = TypeAdapter(cls)
    for name, prop in schema.get("properties", {}).items():
        names = []
        for e in _enums_in(hints.get(name)):
            for member in e:
                try:
                    adapter.validate_json(json.dumps({name: member.name}))
                except Exception:
                    continue
                names.append(member.name)
        if names:
            prop["x-names"] = sorted(set(names))


def _add_requires(cls: Any, schema: dict[str, Any]) -> None:
    from pydantic import TypeAdapter

    adapter = TypeAdapter(cls)
    props = schema.get("properties", {})

    def valid(doc: dict[str, Any]) -> bool:
        try:
            adapter.validate_json(json.dumps(doc))
        except Exception:
            return False
        return True

    def enum_of(prop: dict[str, Any]) -> list[Any]:
        return prop.get("enum") or next((a["enum"] for a in prop.get("anyOf", ()) if "enum" in a), [])

    def takes_text(prop: dict[str, Any]) -> bool:
        kinds = [prop.get("type"), *(a.get("type") for a in prop.get("anyOf", ()))]
        return "string" in kinds and not enum_of(prop)

    requires: dict[str, list[str]] = {}
    for name, prop in props.items():
        if not takes_text(prop) or valid({name: "x"}):
            continue
        needs = [
            other for other, p in props.items() if enum_of(p) and valid({name: "x", other: enum_of(p)[0]})
        ]
        if needs:
            requires[name] = sorted(needs)
    if requires:
        schema["x-requires"] = requires


def custom_options(parser: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for action in parser._actions:
        if type(action).__name__ != "LoRAParserAction":
            continue
        import dataclasses
        import sys

        # the dataclass the action builds each JSON item into, as its own module names it
        fields = dataclasses.fields(sys.modules[type(action).__module__].LoRAModulePath)
        out[action.dest] = {
            "action": f"{type(action).__module__}.{type(action).__qualname__}",
            "item": "name=path or json",
            "fields": sorted(f.name for f in fields),
            "required": sorted(
                f.name
                for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            ),
        }
    return out


def json_options(parser: Any) -> dict[str, Any]:
    from pydantic import TypeAdapter

    out: dict[str, Any] = {}
    for action in parser._actions:
        cls = _dataclass_of(action)
        if cls is None:
            continue
        entry: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}"}
        try:
            entry["schema"] = _strip(TypeAdapter(cls).json_schema())
            _add_enum_names(cls, entry["schema"])
            _add_requires(cls, entry["schema"])
        except Exception as e:  # a field pydantic cannot describe (a plain validator function)
            entry["schema"] = None
            entry["schema_error"] = type(e).__name__
            entry["fields"] = sorted(f for f in getattr(cls, "__dataclass_fields__", {}))
        out[action.dest] = entry
    if not out:
        raise SystemExit("snapshot: no parse_dataclass option found; re-read vllm/engine/arg_utils.py")
    return out


def attention_block_sizes(site: Path, cpu: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    # vllm.platforms.cuda needs libcuda to import: its priority list is read from the source
    # (every backend named in the non-MLA branch of `_get_backend_priorities`), the backends'
    # classes import without a GPU.
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    rel = "vllm/platforms/cuda.py"
    tree = ast.parse((site / rel).read_text(encoding="utf-8"))
    fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    [fn] = [n for n in fns if n.name == "_get_backend_priorities"]
    [branch] = [n for n in fn.body if isinstance(n, ast.If) and ast.unparse(n.test) == "use_mla"]
    names: list[str] = []
    for stmt in branch.orelse:
        for n in ast.walk(stmt):
            enum = isinstance(n, ast.Attribute) and ast.unparse(n.value) == "AttentionBackendEnum"
            if enum and n.attr not in names:
                names.append(n.attr)
    if not names:
        raise SystemExit(f"snapshot: no non-MLA backend in {rel}:_get_backend_priorities; re-read it")
    out: dict[str, Any] = {}
    absent: dict[str, str] = {}  # CPU build only: backend -> why its module does not import
    for name in names:
        try:
            cls = AttentionBackendEnum[name].get_class()
        except ImportError as e:
            if not cpu:
                raise  # a GPU release has every backend its CUDA platform names
            absent[name] = f"{type(e).__name__}: {e}".splitlines()[0]
            continue
        out[name] = [b for b in CANDIDATE_BLOCK_SIZES if cls.supports_block_size(b)]
    return out, absent


def world_size(site: Path) -> dict[str, Any]:
    rel = "vllm/config/parallel.py"
    tree = ast.parse((site / rel).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.FunctionDef) and node.name == "__post_init__"):
            continue
        for stmt in ast.walk(node):
            if (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and ast.unparse(stmt.targets[0]) == "self.world_size"
            ):
                names = sorted(
                    n.attr
                    for n in ast.walk(stmt.value)
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
                )
                return {"factors": names, "file": rel, "line": stmt.lineno, "text": ast.unparse(stmt)}
    raise SystemExit(f"snapshot: no `self.world_size = ...` in ParallelConfig.__post_init__ ({rel})")


ENDPOINT_SOURCES = (
    ("vllm/entrypoints/cli/serve.py", "cmd"),
    ("vllm/entrypoints/launchers/launcher.py", "setup_server"),
    ("vllm/entrypoints/launchers/api_server/entry.py", "build_and_serve"),
)


def endpoint_dests(site: Path, dests: set[str]) -> dict[str, list[str]]:
    """option dest -> the functions that read it (`args.<dest>`), for the three sources."""
    found: dict[str, list[str]] = {}
    for rel, func in ENDPOINT_SOURCES:
        tree = ast.parse((site / rel).read_text(encoding="utf-8"))
        fns = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        fns = [n for n in fns if n.name == func]
        if not fns:
            raise SystemExit(f"snapshot: {func} not in {rel}; re-read the serve entry points")
        for fn in fns:
            for n in ast.walk(fn):
                name = None
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "args":
                    name = n.attr
                elif (
                    isinstance(n, ast.Call)
                    and ast.unparse(n.func) == "getattr"
                    and len(n.args) >= 2
                    and ast.unparse(n.args[0]) == "args"
                    and isinstance(n.args[1], ast.Constant)
                ):
                    name = str(n.args[1].value)
                if name in dests:
                    where = f"{rel}:{func}"
                    if where not in found.setdefault(name, []):
                        found[name].append(where)
    return {k: sorted(v) for k, v in sorted(found.items())}


def _bounds_of(field: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for md in getattr(field, "metadata", ()):
        for k in ("ge", "gt", "le", "lt"):
            v = getattr(md, k, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = v
    return out


def value_bounds(dests: set[str], site: Path) -> dict[str, Any]:
    """dest -> {"bounds": {...}, "field": "Class.name"} for each option whose config field is bounded."""
    import vllm.engine.arg_utils as au

    tree = ast.parse((site / "vllm/engine/arg_utils.py").read_text(encoding="utf-8"))
    [engine_args] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs"]
    named: dict[str, tuple[str, str]] = {}  # dest -> (class, field) its default is read from
    for st in engine_args.body:
        if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value is not None):
            continue
        v = st.value
        if isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name):
            named[st.target.id] = (v.value.id, v.attr)
        elif (
            isinstance(v, ast.Call)
            and ast.unparse(v.func) == "get_field"
            and len(v.args) == 2
            and isinstance(v.args[0], ast.Name)
            and isinstance(v.args[1], ast.Constant)
        ):
            named[st.target.id] = (v.args[0].id, str(v.args[1].value))
    classes = {
        n: c
        for n in dir(au)
        if isinstance(c := getattr(au, n), type) and isinstance(getattr(c, "__pydantic_fields__", None), dict)
    }
    out: dict[str, Any] = {}
    for dest in sorted(dests):
        if dest in named and named[dest][0] in classes:
            cn, fn = named[dest]
            field = classes[cn].__pydantic_fields__.get(fn)
            found = [(f"{cn}.{fn}", _bounds_of(field))] if field is not None else []
        else:
            found = [
                (f"{cn}.{dest}", _bounds_of(c.__pydantic_fields__[dest]))
                for cn, c in sorted(classes.items())
                if dest in c.__pydantic_fields__
            ]
        bounded = [(where, b) for where, b in found if b]
        # fields of that name that disagree (or one unbounded): no bound is recorded
        if bounded and len(bounded) == len(found) and all(b == bounded[0][1] for _, b in bounded):
            out[dest] = {"bounds": bounded[0][1], "field": bounded[0][0]}
    return out


def value_names(dests: set[str]) -> dict[str, Any]:
    """The names each looked-up option takes, tried through vLLM's own lookup."""
    import typing

    out: dict[str, Any] = {}

    def probe(dest: str, candidates: list[str], accepts: Any) -> None:
        if dest not in dests:
            return
        ok = []
        for c in candidates:
            try:
                accepts(c)
            except (ValueError, KeyError):
                continue
            ok.append(c)
        fold = (
            "upper"
            if ok
            and all(n.upper() in ok or n.lower() == "auto" for n in ok)
            and any(n != n.upper() and n.lower() != "auto" for n in ok)
            else "none"
        )
        names = sorted({n.upper() for n in ok} if fold == "upper" else set(ok))
        out[dest] = {"names": names, "fold": fold}

    try:
        from vllm.config.attention import AttentionConfig
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        members = list(AttentionBackendEnum.__members__)
        probe(
            "attention_backend",
            [*members, *(m.lower() for m in members), "auto"],
            AttentionConfig.validate_backend_before,
        )
    except ImportError:
        pass
    try:
        from vllm.config.mamba import MambaBackendEnum

        members = list(MambaBackendEnum.__members__)
        # arg_utils: `MambaBackendEnum[self.mamba_backend.upper()]`
        probe(
            "mamba_backend", [*members, *(m.lower() for m in members)], lambda t: MambaBackendEnum[t.upper()]
        )
    except ImportError:
        pass
    from vllm.transformers_utils import config as tu

    formats = sorted(
        {
            *typing.get_args(getattr(tu, "ConfigFormat", typing.Literal["auto"])),
            *getattr(tu, "_CONFIG_FORMAT_TO_CONFIG_PARSER", {}),
        }
    )
    if "config_format" in dests:
        out["config_format"] = {"names": formats, "fold": "none"}
    return out


def kv_connectors() -> list[str]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return sorted(KVConnectorFactory._registry)


# option dest -> the config class vLLM builds from its JSON object as keyword arguments
DICT_OPTIONS = {"speculative_config": "SpeculativeConfig", "watermark_config": "WatermarkConfig"}


def dict_options(dests: set[str]) -> dict[str, Any]:
    import vllm.engine.arg_utils as au

    out: dict[str, Any] = {}
    for dest, name in DICT_OPTIONS.items():
        cls = getattr(au, name, None)
        if dest not in dests or cls is None:
            continue
        fields = getattr(cls, "__pydantic_fields__", {})
        out[dest] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "fields": sorted(f for f in fields if not f.startswith("_")),
            "required": sorted(f for f, info in fields.items() if info.is_required()),
        }
    return out


def surface_snapshot(parser: Any, site: Path, cpu: bool = False) -> dict[str, Any]:
    helps = sorted(s for a in parser._actions if type(a).__name__ == "_HelpAction" for s in a.option_strings)
    if not helps:
        raise SystemExit("snapshot: the serve parser has no help action")
    dests = {a.dest for a in parser._actions if a.option_strings}
    backends, absent = attention_block_sizes(site, cpu)
    doc = {
        "help_options": helps,
        "json_options": json_options(parser),
        "attention_block_sizes": backends,
        "world_size": world_size(site),
        "endpoint_dests": endpoint_dests(site, dests),
        "memory_dests": sorted(d for d in dests if MEMORY_NAME.search(d)),
        "value_bounds": value_bounds(dests, site),
        "value_names": value_names(dests),
        "kv_connectors": kv_connectors(),
        "dict_options": dict_options(dests),
        "custom_options": custom_options(parser),
    }
    if cpu:
        from cpu_build import cpu_attention

        doc["attention_backends_absent"] = absent
        doc["cpu_attention"] = cpu_attention(site, CANDIDATE_BLOCK_SIZES)
    return doc
