"""Across modules: the house's rules that a machine can hold (docs/architecture.md, "Where things
live"; docs/development.md, "Where the tests live").

* One address per name: every `from rankguard_x.m import n` in the tree names the module that
  DEFINES `n` (or `n` is a submodule of `m`); only a package's `__init__.py` (its face) may hand
  on names it imports. A re-export lets two spellings of one import drift apart.
* Size: no module over 650 lines, and a module over 450 says at the top of its docstring why it
  is one module ("(Over 450 lines because ...)"): modules are split by responsibility, never by
  line count.
* The pure core reads in named steps: no function in operator/rankguard_operator/core over 100
  lines, none over McCabe complexity 20 (ruff's C901: a function that decides more is split
  into the steps it takes, as the pass is into its stages, core/step).
* Tests where the code lives: tests/unit has one folder per room of the source (TEST_ROOMS:
  core/ and edge/ are the operator's rooms, operator/ its top-level modules, agent/, sim/ and
  bench/ mirror theirs, house/ is the repository as a whole), and a test module is named after
  the module it tests, in the folder of that module's room: operator/rankguard_operator/core/
  budget/planner.py is tested by tests/unit/core/budget/test_planner.py, a package's face
  (<package>/__init__.py) by test_<package>.py in the folder that holds the package. A
  module's tests are one file; a second kind of setup (a property test, a recorded snapshot,
  a real subprocess) or a file past 450 lines makes another, test_<module>_<aspect>.py, where
  <module> is the longest name that exists in that folder (test_planner_properties.py:
  planner.py, aspect "properties"). A test module of behaviour across modules (a whole
  reconcile story, the chart, a script: everything in house/) says so on the first line of
  its docstring, which begins with the marker "Across modules:" and names what it tests.
  Every folder is a package (tests.unit.core.budget), so two rooms may each have a
  test_pod.py; a folder's fixtures are in its conftest.py, and a helper module the tests
  import (reconcile_world, launched, ...) lives in the lowest folder all its importers share
  and is imported by its full name (`from tests.unit.reconcile_world import Cluster`).

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

from tests import REPO

ROOT = REPO
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
    "sim/rankguard_sim/kubelet/pod/meta.py": "import rankguard_operator.core.units",  # sim -> model
    "sim/rankguard_sim/physics/engine_config.py": "import rankguard_agent.wire.report",  # physics -> agent
    # an offline command -> the I/O edge
    "operator/rankguard_operator/cli_render.py": "import rankguard_operator.edge.k8s",
    # the executor around the step's face
    "operator/rankguard_operator/edge/executor.py": "import rankguard_operator.core.policy.history",
    # the edge into a room of core it takes nothing from
    "operator/rankguard_operator/edge/metrics.py": "import rankguard_operator.core.budget.planner",
}


CORE = ROOT / "operator" / "rankguard_operator" / "core"
MAX_FUNCTION_LINES = 100
MAX_COMPLEXITY = 20


def long_functions(root: Path) -> list[str]:
    """`path:line name (n lines)` of each function under `root` longer than MAX_FUNCTION_LINES."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def complex_functions(root: Path) -> list[str]:
    """ruff's C901 findings under `root` above MAX_COMPLEXITY (empty when there are none)."""
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run(
        [
            str(ruff),
            "check",
            "--no-cache",
            "--isolated",
            "--select",
            "C901",
            "--config",
            f"lint.mccabe.max-complexity = {MAX_COMPLEXITY}",
            "--output-format",
            "concise",
            str(root),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return [line for line in proc.stdout.splitlines() if "C901" in line]


def test_the_core_reads_in_named_steps() -> None:
    assert not long_functions(CORE), long_functions(CORE)
    assert not complex_functions(CORE), complex_functions(CORE)


def test_the_step_checks_can_fail(tmp_path: Path) -> None:
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(MAX_COMPLEXITY + 1))
    (tmp_path / "branchy.py").write_text(f"def decide(x: int) -> int:\n{branches}    return -1\n")
    body = "".join(f"    y = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def grow() -> int:\n{body}    return y\n")
    assert [p.split(":")[0] for p in long_functions(tmp_path)] == ["long.py"]
    assert len(complex_functions(tmp_path)) == 1 and "decide" in complex_functions(tmp_path)[0]


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


# ------------------------------------------------------------------- tests where the code lives
TESTS = "tests/unit"
# tests/unit/<room>/... mirrors the source folder named here; house/ mirrors nothing.
TEST_ROOMS = {
    "core": "operator/rankguard_operator/core",
    "edge": "operator/rankguard_operator/edge",
    "operator": "operator/rankguard_operator",  # its top-level modules: core and edge have their own
    "agent": "agent/rankguard_agent",
    "sim": "sim/rankguard_sim",
    "bench": "bench",
}
ACROSS_MODULES = "Across modules:"


def module_of_test(test: Path, root: Path) -> Path | None:
    """The module `tests/unit/<room>/<folders>/test_<module>[_<aspect>].py` names: <module>.py (or
    the package <module>/__init__.py) in the room's source folder and <folders>, the longest
    <module> that exists there; None where there is none."""
    room, *folders = test.relative_to(root / TESTS).parent.parts or ("",)
    source = TEST_ROOMS.get(room)
    if source is None or (room == "operator" and folders):
        return None
    where = root / source / Path(*folders)
    words = test.stem.removeprefix("test_").split("_")
    for n in range(len(words), 0, -1):
        name = "_".join(words[:n])
        for candidate in (where / f"{name}.py", where / name / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def layout_problems(root: Path) -> list[str]:
    """The test modules under root's tests/unit that name no module, and whose docstring does not
    begin with the marker of a test across modules."""
    wrong: list[str] = []
    for test in sorted((root / TESTS).rglob("test_*.py")):
        doc = ast.get_docstring(ast.parse(test.read_text())) or ""
        if not doc.startswith(ACROSS_MODULES) and module_of_test(test, root) is None:
            wrong.append(str(test.relative_to(root)))
    return wrong


def test_every_test_module_names_its_module_or_says_it_is_across_modules() -> None:
    wrong = layout_problems(ROOT)
    assert not wrong, (
        f"test modules that name no module (tests/unit/<room>/test_<module>[_<aspect>].py) and do "
        f"not begin their docstring with {ACROSS_MODULES!r}:\n" + "\n".join(wrong)
    )


def test_every_test_folder_is_a_package() -> None:
    """Test modules are imported by their full name (tests.unit.core.render.test_pod), so two
    rooms may hold modules of one name: a folder without __init__.py would import its modules by
    their bare name, and the second test_pod.py would not import at all."""
    bare = [
        str(d.relative_to(ROOT))
        for d in [ROOT / "tests", ROOT / TESTS, *(ROOT / TESTS).rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").is_file()
    ]
    assert not bare, "test folders without __init__.py:\n" + "\n".join(bare)


def test_the_layout_check_can_fail(tmp_path: Path) -> None:
    """The same check over a tree of its own: a misspelt module, a module in another room's
    folder, a test outside every room and a marker below the first line are each caught."""
    (tmp_path / TEST_ROOMS["core"] / "budget").mkdir(parents=True)
    (tmp_path / TEST_ROOMS["core"] / "budget" / "planner.py").write_text("")
    (tmp_path / TEST_ROOMS["agent"] / "wire").mkdir(parents=True)
    (tmp_path / TEST_ROOMS["agent"] / "wire" / "__init__.py").write_text("")
    tests = {
        "core/budget/test_planner.py": "The planner.",
        "core/budget/test_planner_properties.py": "The planner, an aspect.",
        "agent/test_wire.py": "A package, by its face.",
        "core/budget/test_story.py": "Across modules: a story.",
        "core/budget/test_planer.py": "A misspelt module.",
        "core/test_planner.py": "The planner, in the room above its own.",
        "edge/test_planner.py": "The planner, in another room.",
        "test_planner.py": "The planner, in no room.",
        "core/budget/test_late.py": "A story.\n\nAcross modules: said below the first line.",
    }
    for rel, doc in tests.items():
        path = tmp_path / TESTS / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""{doc}"""\n')
    assert module_of_test(tmp_path / TESTS / "core/budget/test_planner_properties.py", tmp_path) == (
        tmp_path / TEST_ROOMS["core"] / "budget" / "planner.py"
    )
    assert layout_problems(tmp_path) == [
        f"{TESTS}/{rel}"
        for rel in (
            "core/budget/test_late.py",
            "core/budget/test_planer.py",
            "core/test_planner.py",
            "edge/test_planner.py",
            "test_planner.py",
        )
    ]
