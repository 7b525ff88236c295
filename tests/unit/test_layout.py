"""The house's rules that a machine can hold (docs/architecture.md, "Where things live").

* One address per name: every `from rankguard_x.m import n` in the tree names the module that
  DEFINES `n` (or `n` is a submodule of `m`); only a package's `__init__.py` (its face) may hand
  on names it imports. A re-export lets two spellings of one import drift apart.
* Size: no module over 650 lines, and a module over 450 says at the top of its docstring why it
  is one module ("(Over 450 lines because ...)"): modules are split by responsibility, never by
  line count.

The layers (which room may import which) are import-linter's contracts (.importlinter), run by
`make lint`.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = {"rankguard_operator": "operator", "rankguard_agent": "agent", "rankguard_sim": "sim"}
SCRIPTS = ("agent/rankguard-agent", "sim/rankguard_sim/bin/vllm")
MAX_LINES = 650
EXPLAIN_ABOVE = 450
WHY_ONE_MODULE = re.compile(r"\(Over \d+ lines")


def _files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py", *SCRIPTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / f for f in out if (ROOT / f).is_file()]


def _module_file(module: str) -> Path | None:
    top = module.split(".", maxsplit=1)[0]
    if top not in SOURCE_ROOTS:
        return None
    base = ROOT / SOURCE_ROOTS[top] / Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)

    visit(tree.body)
    return names


def _defined() -> dict[Path, set[str]]:
    return {
        f: _top_level_names(ast.parse(f.read_text()))
        for f in _files()
        if f.suffix == ".py" and any(f.is_relative_to(ROOT / r) for r in SOURCE_ROOTS.values())
    }


def test_every_import_names_the_module_that_defines_the_name() -> None:
    defined = _defined()
    wrong: list[str] = []
    for f in _files():
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            source = _module_file(node.module)
            if source is None or source.name == "__init__.py":
                continue  # not ours, or a package's face
            for alias in node.names:
                if _module_file(f"{node.module}.{alias.name}") is not None:
                    continue
                if alias.name not in defined.get(source, set()):
                    wrong.append(f"{f.relative_to(ROOT)}:{node.lineno}: {alias.name} from {node.module}")
    assert not wrong, "imported from a module that does not define it:\n" + "\n".join(wrong)


def test_the_import_check_can_fail(tmp_path: Path) -> None:
    """A re-export is caught: the same walk over a module that only imports the name."""
    tree = ast.parse("from rankguard_operator.core.units import GiB\n")
    assert "GiB" not in _top_level_names(tree)
    assert "GiB" in _top_level_names(
        ast.parse((ROOT / "operator/rankguard_operator/core/units.py").read_text())
    )


@pytest.mark.parametrize("root", [*SOURCE_ROOTS.values(), "tests", "bench", "hack"])
def test_modules_are_split_by_responsibility_not_grown_without_bound(root: str) -> None:
    too_long: list[str] = []
    unexplained: list[str] = []
    for f in _files():
        if not f.is_relative_to(ROOT / root) or f.suffix != ".py":
            continue
        text = f.read_text()
        n = len(text.splitlines())
        if n > MAX_LINES:
            too_long.append(f"{f.relative_to(ROOT)}: {n} lines")
        elif n > EXPLAIN_ABOVE:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if not WHY_ONE_MODULE.search(doc):
                unexplained.append(f"{f.relative_to(ROOT)}: {n} lines")
    assert not too_long, f"over {MAX_LINES} lines: split by responsibility:\n" + "\n".join(too_long)
    assert not unexplained, (
        f"over {EXPLAIN_ABOVE} lines without saying at the top why it is one module:\n"
        + "\n".join(unexplained)
    )


# One wrong import per contract of .importlinter, each in a module of the room it must not leave.
WRONG_IMPORTS: dict[str, str] = {
    "operator/rankguard_operator/core/spec/fields.py": "import rankguard_operator.core.step.world",  # upward
    "operator/rankguard_operator/core/units.py": "import kopf",  # core does no I/O
    "operator/rankguard_operator/edge/reads.py": "import rankguard_sim.waiting",  # operator -> sim
    "operator/rankguard_operator/edge/scrape.py": "import rankguard_agent.launcher",  # beyond the wire
    "agent/rankguard_agent/workers.py": "import rankguard_operator.core.units",  # agent -> operator
    "agent/rankguard_agent/wire/termination.py": "import rankguard_agent.constants",  # wire -> agent
    "sim/rankguard_sim/physics/gpus.py": "import rankguard_sim.world",  # upward in the sandbox
    "sim/rankguard_sim/kubelet/podmeta.py": "import rankguard_operator.core.units",  # sim -> model
    "sim/rankguard_sim/physics/engine_config.py": "import rankguard_agent.wire.report",  # physics -> agent
}


def test_every_import_contract_breaks_on_a_wrong_import(tmp_path: Path) -> None:
    """The contracts are not vacuous: a copy of the tree with one wrong import per contract
    breaks every one of them (and the tree as it is keeps them all, `make lint`)."""
    for root in SOURCE_ROOTS.values():
        shutil.copytree(ROOT / root, tmp_path / root, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, line in WRONG_IMPORTS.items():
        path = tmp_path / rel
        text = path.read_text()
        at = text.index("\nfrom __future__ import annotations\n") + len(
            "\nfrom __future__ import annotations\n"
        )
        path.write_text(text[:at] + line + "\n" + text[at:])
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    lint = Path(sys.executable).parent / "lint-imports"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(tmp_path / r) for r in SOURCE_ROOTS.values())}
    proc = subprocess.run(
        [str(lint), "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    out = " ".join(proc.stdout.split())
    contracts = len(re.findall(r"^\[importlinter:contract:", (ROOT / ".importlinter").read_text(), re.M))
    assert proc.returncode != 0, out
    assert f"Contracts: 0 kept, {contracts} broken." in out, out
    assert contracts == len(WRONG_IMPORTS)


def test_the_architecture_page_names_every_module() -> None:
    """docs/architecture.md's tree ("Where things live") is the map a newcomer reads the loop
    from: every module of the operator, the agent and the sandbox is on it by name."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text[text.index("## Where things live") : text.index("## The one data path")]
    missing = [
        str(f.relative_to(ROOT))
        for f in _files()
        if f.suffix == ".py"
        and f.name != "__init__.py"
        and any(f.is_relative_to(ROOT / r) for r in SOURCE_ROOTS.values())
        and not re.search(rf"\b{re.escape(f.stem)}\b", tree)
    ]
    assert not missing, "docs/architecture.md's tree does not name:\n" + "\n".join(missing)
