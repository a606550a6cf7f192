"""The package's import graph: no cycles, and floors that match roles (DESIGN.md's layout).

Imports are read from the source with ``ast``, not by importing. What counts as an edge:

- module-level imports, and imports inside functions and methods too: a deferred import still
  makes the importer depend on the imported, and a loop of deferred imports is how
  ``sft -> trainer -> tiny -> sft`` once hid (each import ran late enough to work, until one
  day it would not);
- not the imports under ``if TYPE_CHECKING:`` (they never run; annotations only);
- not ``importlib.import_module`` of a string (the learner registry loads backends by name).

``from pkg import name`` is an edge to ``pkg.name`` when that is a module of the package, else to
``pkg``. Importing a submodule also runs its package's ``__init__``, but that is not counted as an
edge (a package that re-exports its submodules would otherwise always be a cycle).
"""

from __future__ import annotations

import ast
import doctest
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The import names of the package and the folders they live in (pyproject.toml's package-dir).
ROOTS = {"agentrl": REPO / "agentrl", "agentrl.envs": REPO / "envs", "agentrl.actors": REPO / "actors"}


def package_modules(roots: dict[str, Path] = ROOTS) -> dict[str, Path]:
    """Import name -> source file of every module of the package."""
    modules = {}
    for package, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_modules(path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package modules ``path`` imports (at any depth, TYPE_CHECKING blocks aside) -> first line."""
    found: dict[str, int] = {}

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_node(other)
                continue
            visit_node(child)

    def visit_node(node: ast.AST) -> None:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        for name in names:
            if name in modules:
                found.setdefault(name, node.lineno)
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    return {name: {m: line for m, line in imported_modules(path, modules).items() if m != name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := walk(start)):
            return cycle
    return None


def _describe(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    return "\n".join(f"  {modules[a].relative_to(REPO)}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_no_import_cycles_in_the_package():
    modules = package_modules()
    assert {"agentrl.driver.trainer", "agentrl.envs.base", "agentrl.actors.learner"} <= set(modules)
    graph = import_graph(modules)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + _describe(cycle, graph, modules)


def test_cycle_finder_sees_a_loop_of_deferred_imports(tmp_path):
    # The shape of the loop this file was written for: three modules, each import inside a function.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import g\n    return g\n")
    (pkg / "b.py").write_text("class C:\n    def m(self):\n        from pkg import c\n        return c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.b\n"
                              "def h():\n    import pkg.a\n")
    modules = package_modules({"pkg": pkg})
    graph = import_graph(modules)
    assert graph["pkg.c"] == {"pkg.a": 5}  # the TYPE_CHECKING import is not an edge
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("def h():\n    return 1\n")
    assert find_cycle(import_graph(package_modules({"pkg": pkg}))) is None


def test_floors_match_roles():
    """The driver imports helpers, never the other way; core knows nothing of Ray; envs nothing
    of Ray or vLLM (DESIGN.md, STYLE.md)."""
    modules = package_modules()
    graph = import_graph(modules)
    importers_of_trainer = {m for m, deps in graph.items() if "agentrl.driver.trainer" in deps}
    assert importers_of_trainer <= {"agentrl.driver.pipeline"}, importers_of_trainer
    # the driver is three modules: the loop (trainer), its fault handling (supervision) and its
    # weight syncs (weight_sync), parts of it that only the loop imports
    for part in ("agentrl.driver.supervision", "agentrl.weights.sync"):
        importers = {m for m, deps in graph.items() if part in deps}
        assert importers <= {"agentrl.driver.trainer"}, (part, importers)
    driver = {"agentrl.driver.trainer", "agentrl.driver.supervision", "agentrl.weights.sync"}
    for name, path in modules.items():
        external = _external_imports(path)
        if not (name.startswith("agentrl.actors") or name in driver):
            assert "ray" not in external, f"{path.relative_to(REPO)} imports Ray"
        if name.startswith("agentrl.envs"):
            assert not {"ray", "vllm"} & external, f"{path.relative_to(REPO)} imports Ray or vLLM"
            assert not {m for m in graph[name] if not m.startswith(("agentrl.envs", "agentrl.rollout.tool_calls",
                                                                      "agentrl.rollout.chat"))}, name
    # Model loading has one home: the driver, SFT, eval and the learners reach it there.
    for user in ("agentrl.driver.trainer", "agentrl.driver.pipeline", "agentrl.driver.sft", "agentrl.driver.evaluate",
                 "agentrl.learner.torch_learner"):
        assert "agentrl.model.loading" in graph[user], user
    assert "agentrl.learner.optim" in graph["agentrl.model.tiny"] and "agentrl.driver.sft" not in graph["agentrl.model.tiny"]


def _external_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("old, new", [
    ("agentrl.driver.trainer:resolve_model_path", "agentrl.model.loading:resolve_model_path"),
    ("agentrl.driver.sft:plateau_schedule", "agentrl.learner.optim:plateau_schedule"),
])
def test_moved_names_still_import_with_a_deprecation(old, new):
    import importlib

    old_mod, name = old.split(":")
    new_mod, new_name = new.split(":")
    with pytest.warns(DeprecationWarning, match=new_mod):
        moved = getattr(importlib.import_module(old_mod), name)
    assert moved is getattr(importlib.import_module(new_mod), new_name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(f"from {new_mod} import {new_name}", {})  # the new home: no warning
    with pytest.raises(AttributeError):
        importlib.import_module(old_mod).no_such_name  # noqa: B018


def test_load_hf_model_keeps_its_learner_path():
    from agentrl.learner.torch_learner import load_hf_model
    from agentrl.model.loading import load_hf_model as home

    assert load_hf_model is home


@pytest.mark.parametrize("module", ["agentrl.model.loading", "agentrl.learner.optim", "agentrl.driver.progress", "agentrl.learner.lora"])
def test_doctests(module):
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted and not result.failed
