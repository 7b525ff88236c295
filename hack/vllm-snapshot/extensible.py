"""engine.json's `extensible_kv_cache` block: how a vLLM release sizes its KV cache after warm-up.

vLLM 0.34 reserves the KV cache's address range, runs warm-up and CUDA-graph capture, measures
the memory left on every rank and commits the cache from the minimum (the "extensible KV cache").
A release without vllm/v1/worker/extensible_kv_cache.py has no such mode: its engine.json has no
block. Every fact is read from the installed release, with its file:line under `source`:

- the module constants (margin floor and fraction, the reserve left to non-torch allocations),
  evaluated from their source expression once per platform (`current_platform.is_rocm()` is
  the only name they may use), since the import on CPU sees only the CUDA branch;
- the default utilisation per mode, from CacheConfig objects (`resolved_gpu_memory_utilization`);
- the utilisation warning's bounds, from `measure_kv_cache_blocks`' two tests;
- why the mode is off, from `_resolve_extensible_kv_cache`'s `unsupported = ...` chain (each
  test must name exactly one OFF_REASON_TESTS fragment) and the IMEX line that turns the default off;
- each registered KV connector's access flags (vllm.config.kv_transfer.KVCacheAccess), asked of
  KVConnectorFactory.kv_cache_access with kv_buffer_device cuda ("device") and cpu; a connector
  that does not import here is recorded with the error's one line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

MODULE = "vllm/v1/worker/extensible_kv_cache.py"
CONFIG = "vllm/config/vllm.py"
CACHE = "vllm/config/cache.py"
FACTORY = "vllm/distributed/kv_transfer/kv_connector/factory.py"
# contract name -> the module constant
CONSTANTS = {
    "margin_floor_bytes": "KV_CACHE_MARGIN_FLOOR_BYTES",
    "margin_fraction": "KV_CACHE_MARGIN_FRACTION",
    "non_torch_reserve_bytes": "KV_CACHE_NON_TORCH_RESERVE_BYTES",
}
# off reason -> the fragment its `if`/`elif` test holds in _resolve_extensible_kv_cache
OFF_REASON_TESTS = {
    "platform": "is_cuda_alike()",
    "kv_cache_memory_bytes": "kv_cache_memory_bytes is not None",
    "num_gpu_blocks_override": "num_gpu_blocks_override is not None",
    "elastic_ep": "enable_elastic_ep",
    "legacy_ipc": "KVCacheAccess.LEGACY_IPC",
    "custom_mem_pool": "uses_custom_mem_pool()",
    "rocm_registers": "current_platform.is_rocm()",
}
_ROCM_TEST = "current_platform.is_rocm()"


def _stop(what: str) -> None:
    sys.exit(f"snapshot: {what}; re-read it")


def _function(tree: ast.AST, name: str, where: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        _stop(f"{name} is not in {where} exactly once")
    return found[0]


class _OnPlatform(ast.NodeTransformer):
    """`current_platform.is_rocm()` replaced by its value on one platform."""

    def __init__(self, rocm: bool) -> None:
        self.rocm = rocm

    def visit_Call(self, node: ast.Call) -> ast.AST:
        return ast.Constant(self.rocm) if ast.unparse(node) == _ROCM_TEST else node


def _per_platform(expr: ast.expr, where: str) -> dict[str, int | float]:
    """The expression's value on CUDA and on ROCm: `current_platform.is_rocm()` is its only name."""
    out: dict[str, int | float] = {}
    for platform, rocm in (("cuda", False), ("rocm", True)):
        fixed = ast.fix_missing_locations(_OnPlatform(rocm).visit(ast.parse(ast.unparse(expr), mode="eval")))
        allowed = (ast.Expression, ast.Constant, ast.BinOp, ast.IfExp, ast.operator)
        if not all(isinstance(n, allowed) for n in ast.walk(fixed)):
            _stop(f"{where}: {ast.unparse(expr)!r} is not constant arithmetic per platform")
        out[platform] = eval(compile(fixed, where, "eval"), {"__builtins__": {}})  # constants only (above)
    return out


def _constants(site: Path) -> tuple[dict[str, Any], dict[str, str]]:
    tree = ast.parse((site / MODULE).read_text(encoding="utf-8"))
    assigns = {
        n.targets[0].id: n
        for n in tree.body
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
    }
    facts: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, const in CONSTANTS.items():
        if const not in assigns:
            _stop(f"{MODULE} has no module-level {const}")
        node = assigns[const]
        values = _per_platform(node.value, f"{MODULE}:{node.lineno}")
        # one value on every platform is recorded plain, as the contract's margin_fraction is
        facts[name] = values["cuda"] if values["cuda"] == values["rocm"] else values
        source[name] = f"{MODULE}:{node.lineno}"
    return facts, source


def _warning(site: Path) -> tuple[dict[str, Any], str]:
    """`0.7 < utilization < 1.0` and `withheld >= 1 << 30` in measure_kv_cache_blocks."""
    fn = _function(ast.parse((site / MODULE).read_text(encoding="utf-8")), "measure_kv_cache_blocks", MODULE)
    chains = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Compare)
        and [type(o) for o in n.ops] == [ast.Lt, ast.Lt]
        and isinstance(n.left, ast.Constant)
        and isinstance(n.comparators[1], ast.Constant)
    ]
    floors = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Compare)
        and [type(o) for o in n.ops] == [ast.GtE]
        and ast.unparse(n.left) == "withheld"
    ]
    if len(chains) != 1 or len(floors) != 1:
        _stop(f"{MODULE}: measure_kv_cache_blocks has no single `a < utilization < b` and `withheld >= x`")
    above, below = chains[0].left, chains[0].comparators[1]
    assert isinstance(above, ast.Constant) and isinstance(below, ast.Constant)
    withheld = _per_platform(floors[0].comparators[0], f"{MODULE}:{floors[0].lineno}")["cuda"]
    return (
        {"above": above.value, "below": below.value, "withheld_bytes": withheld},
        f"{MODULE}:{chains[0].lineno}",
    )


def _off_reasons(site: Path) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(reason key -> text, reason key -> file:line, default-off line key -> text)."""
    fn = _function(
        ast.parse((site / CONFIG).read_text(encoding="utf-8")), "_resolve_extensible_kv_cache", CONFIG
    )
    reasons: dict[str, str] = {}
    lines: dict[str, str] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.If):
            continue
        sets = [
            s.value.value
            for s in node.body
            if isinstance(s, ast.Assign)
            and ast.unparse(s.targets[0]) == "unsupported"
            and isinstance(s.value, ast.Constant)
            and isinstance(s.value.value, str)
        ]
        if not sets:
            continue
        test = ast.unparse(node.test)
        keys = [k for k, frag in OFF_REASON_TESTS.items() if frag in test]
        if len(keys) != 1 or keys[0] in reasons:
            _stop(f"{CONFIG}:{node.lineno}: `{test}` names {keys} of the known off reasons")
        reasons[keys[0]] = sets[0]
        lines[keys[0]] = f"{CONFIG}:{node.lineno}"
    if sorted(reasons) != sorted(OFF_REASON_TESTS):
        _stop(f"{CONFIG}: _resolve_extensible_kv_cache lacks {sorted(set(OFF_REASON_TESTS) - set(reasons))}")
    # the default turned off without an IMEX channel: the one logger.info of the function
    infos = [
        str(n.args[0].value)
        for n in ast.walk(fn)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) == "logger.info"
        and isinstance(n.args[0], ast.Constant)
        and "IMEX" in str(n.args[0].value)
    ]
    if len(infos) != 1:
        _stop(f"{CONFIG}: no single IMEX line turns the default off in _resolve_extensible_kv_cache")
    return reasons, lines, {"no_imex_channel": infos[0]}


def _utilisation(site: Path) -> tuple[dict[str, float], str]:
    from vllm.config.cache import CacheConfig

    lines = (site / CACHE).read_text(encoding="utf-8").splitlines()
    where = [i + 1 for i, line in enumerate(lines) if "def resolved_gpu_memory_utilization" in line]
    if len(where) != 1:
        _stop(f"{CACHE} has no single resolved_gpu_memory_utilization")
    return (
        {
            "default_utilization": CacheConfig(
                enable_extensible_kv_cache=True
            ).resolved_gpu_memory_utilization,
            "estimate_default_utilization": CacheConfig(
                enable_extensible_kv_cache=False
            ).resolved_gpu_memory_utilization,
        },
        f"{CACHE}:{where[0]}",
    )


def _connectors() -> tuple[dict[str, Any], list[str]]:
    from vllm.config.kv_transfer import KVCacheAccess, KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    flags = [m for m in KVCacheAccess if m]  # IN_PROCESS (0) is no flag
    out: dict[str, Any] = {}
    for name in sorted(KVConnectorFactory._registry):
        entry: dict[str, Any] = {}
        for label, device in (("device", "cuda"), ("cpu", "cpu")):
            try:
                config = KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_buffer_device=device)
                access = KVConnectorFactory.kv_cache_access(config)
            except Exception as e:  # a connector whose own package is not installed here
                entry = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()}
                break
            entry[label] = [str(m.name) for m in flags if m in access]
        out[name] = entry
    return out, [str(m.name) for m in flags]


def extensible_facts(site: Path) -> dict[str, Any] | None:
    """The block, or None for a release without the extensible KV cache."""
    if not (site / MODULE).exists():
        return None
    constants, source = _constants(site)
    warning, source["warning"] = _warning(site)
    reasons, reason_lines, default_off = _off_reasons(site)
    utilisation, source["default_utilization"] = _utilisation(site)
    connectors, flags = _connectors()
    return {
        **constants,
        **utilisation,
        "warning": warning,
        "off_reasons": reasons,
        "default_off": default_off,
        "connectors": connectors,
        "access_flags": flags,
        "source": {
            **source,
            "estimate_default_utilization": source["default_utilization"],
            "off_reasons": reason_lines,
            "default_off": f"{CONFIG}: _resolve_extensible_kv_cache",
            "connectors": f"{FACTORY}: KVConnectorFactory.kv_cache_access",
        },
    }
