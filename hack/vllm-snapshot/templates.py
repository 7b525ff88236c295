"""Message templates out of vLLM's Python source: a string literal, an f-string, or an f-string
that a parameter's string default completes.

A literal is its own template (`percent` when it holds a %-placeholder, else `plain`); an
f-string becomes a str.format template (`format`), each expression a numbered field with its
conversion and format spec, the expressions' source kept in order. A composed template is an
f-string that starts with a parameter whose default is a string literal: the default completes it
(vLLM 0.34's capture bar, `tqdm(descs, desc=f"{progress_bar_desc} ({mode.name})")`). snapshot.py
records them; nothing here imports vLLM.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any


def template(node: ast.expr) -> tuple[str, str, list[str]] | None:
    """(style, template, expressions) for a string literal or an f-string; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return ("percent" if re.search(r"%[sd.0-9]", node.value) else "plain", node.value, [])
    if isinstance(node, ast.JoinedStr):
        parts: list[str] = []
        exprs: list[str] = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value).replace("{", "{{").replace("}", "}}"))
            elif isinstance(v, ast.FormattedValue):
                spec = ""
                if v.format_spec is not None:
                    spec = ":" + "".join(
                        str(s.value) for s in v.format_spec.values if isinstance(s, ast.Constant)
                    )
                conv = "" if v.conversion == -1 else "!" + chr(v.conversion)
                parts.append("{" + str(len(exprs)) + conv + spec + "}")
                exprs.append(ast.unparse(v.value))
        return ("format", "".join(parts), exprs)
    return None


def literals(tree: ast.AST) -> list[tuple[int, ast.expr]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) or (
            isinstance(node, ast.Constant) and isinstance(node.value, str)
        ):
            found.append((node.lineno, node))
    return found


def composed_messages(site: Path, frag: str, param: str) -> list[dict[str, Any]]:
    """Templates `f"{param}..."` in functions whose `param` defaults to a string, the default in place."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for path in sorted((site / "vllm").rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if param not in text:
            continue
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, ast.FunctionDef):
                continue
            args = [*fn.args.posonlyargs, *fn.args.args]
            pairs = [*zip(args[len(args) - len(fn.args.defaults) :], fn.args.defaults, strict=True)]
            pairs += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True) if d]
            default = next((d for a, d in pairs if a.arg == param), None)
            if not (isinstance(default, ast.Constant) and isinstance(default.value, str)):
                continue
            for node in ast.walk(fn):
                head = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else None
                if not (isinstance(head, ast.FormattedValue) and ast.unparse(head.value) == param):
                    continue
                t = template(ast.JoinedStr([ast.Constant(default.value), *node.values[1:]]))
                if t is not None and frag in t[1]:
                    found[(str(path.relative_to(site)), node.lineno)] = {
                        "file": str(path.relative_to(site)),
                        "line": node.lineno,
                        "style": t[0],
                        "template": t[1],
                        "exprs": t[2],
                        "composed": f"{param} defaults to {default.value!r} (line {default.lineno})",
                    }
    return [found[k] for k in sorted(found)]
