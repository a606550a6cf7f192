"""The package's import graph: no cycles, role packages in one order, and what each may import.

Imports are read from the source with ``ast``, not by importing. What counts as an edge:

- module-level imports, and imports inside functions and methods too: a deferred import still
  makes the importer depend on the imported, and a loop of deferred imports is how
  ``sft -> trainer -> tiny -> sft`` once hid (each import ran late enough to work, until one
  day it would not);
- not the imports under ``if TYPE_CHECKING:`` (they never run; annotations only);
- not ``importlib.import_module`` of a string (the learner registry loads backends by name, the
  role packages' ``__init__`` their lazy re-exports).

``from pkg import name`` is an edge to ``pkg.name`` when that is a module of the package, else to
``pkg``. Importing a submodule also runs its package's ``__init__``, but that is not counted as an
edge (a package that re-exports its submodules would otherwise always be a cycle).
"""

from __future__ import annotations

import ast
import doctest
import subprocess
import sys
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


# The role packages, lowest first. A module may import from its own package and from lower ones;
# its package is the longest of these that prefixes its name. The root package and its private
# helpers sit below them all, the other top-level modules (the CLI, docs, plots, test helpers and
# the kept import paths) above them all. An order with no upward edge also has no cycle between packages.
ORDER = [
    "agentrl.config",
    "agentrl.rollout",
    "agentrl.envs",
    "agentrl.env",
    "agentrl.rollout.agent",
    "agentrl.replay",
    "agentrl.model",
    "agentrl.weights",
    "agentrl.learner",
    "agentrl.engine",
    "agentrl.actors",
    "agentrl.driver",
]
# The upward imports there are, each with its reason. A new one fails the test; so does one that is
# gone (remove it here).
UPWARD = {
    ("agentrl.config.rollout", "agentrl.rollout.tool_calls"):
        "a config's tool_parser is checked against the parsers there are (tool_calls imports no agentrl module)",
    ("agentrl.config.registry", "agentrl.env.ids"):
        "a module:name component's module is imported as an env module is (deferred, in check_components)",
    ("agentrl.model.tiny", "agentrl.learner.hf_forward"): "the tiny model's induction pretraining runs the learner's packed forward",
    ("agentrl.model.tiny", "agentrl.learner.optim"): "... with the learner's optimizer",
    ("agentrl.model.tiny", "agentrl.learner.packing"): "... on the learner's packed micro-batches",
    ("agentrl.weights.vllm_worker", "agentrl.learner.common"): "the engine reports its GPU memory as the learner does",
    ("agentrl.actors.watchdog", "agentrl.driver.watchdog"): "the probing actor uses the driver's deadlines and report",
}
BASE = {"agentrl", "agentrl._lazy", "agentrl.progress_watch"}  # stdlib-only helpers
# Modules that import Ray, vLLM or Megatron-Core as they are imported (at module level); any other
# module defers them into the function that needs them.
MODULE_LEVEL = {
    "ray": {"agentrl.actors.engine", "agentrl.actors.learner", "agentrl.actors.placement",
            "agentrl.actors.replay", "agentrl.actors.rollout", "agentrl.actors.watchdog", "agentrl.actors.weights",
            "agentrl.driver.supervision", "agentrl.driver.trainer", "agentrl.weights.sync"},
    "vllm": set(),
    "megatron": {"agentrl.learner.megatron.attention", "agentrl.learner.megatron.model"},
}
# Older import paths that docs once taught, kept as re-exports of their new home.
KEPT_PATHS = {"agentrl.chat": "agentrl.rollout.chat", "agentrl.packing": "agentrl.learner.packing",
              "agentrl.trainer": "agentrl.driver.trainer"}


def level(module: str) -> int:
    """The rank of a module's role package in ``ORDER`` (-1: the base; len(ORDER): the top level)."""
    if module in BASE:
        return -1
    roles = [r for r in ORDER if module == r or module.startswith(r + ".")]
    return ORDER.index(max(roles, key=len)) if roles else len(ORDER)


def upward_imports(graph: dict[str, dict[str, int]]) -> set[tuple[str, str]]:
    return {(a, b) for a, deps in graph.items() for b in deps if level(b) > level(a)}


def test_role_packages_import_only_downward():
    modules = package_modules()
    graph = import_graph(modules)
    assert {m for m in modules if level(m) == len(ORDER)} == {
        "agentrl.cli", "agentrl.docs", "agentrl.plot", "agentrl.strategies", "agentrl.testing", *KEPT_PATHS}
    found = upward_imports(graph)
    new = {f"{modules[a].relative_to(REPO)}:{graph[a][b]} imports {b}" for a, b in found - set(UPWARD)}
    assert not new, "imports up the role order (ORDER in tests/test_imports.py):\n" + "\n".join(sorted(new))
    assert not set(UPWARD) - found, f"gone; remove from UPWARD: {sorted(set(UPWARD) - found)}"


def test_order_check_sees_an_upward_import():
    # config is the lowest role: a config module importing the driver must be reported
    modules = package_modules()
    graph = import_graph(modules)
    graph["agentrl.config.base"] = {**graph["agentrl.config.base"], "agentrl.driver.trainer": 1}
    assert ("agentrl.config.base", "agentrl.driver.trainer") in upward_imports(graph)
    assert level("agentrl.rollout.agent.user") > level("agentrl.env.ids") > level("agentrl.rollout.chat")


def test_floors_match_roles():
    """The driver's loop is imported by the pipeline only; Ray, vLLM and Megatron-Core are imported
    at module level only where listed; envs import nothing of Ray or vLLM."""
    modules = package_modules()
    graph = import_graph(modules)
    importers_of_trainer = {m for m, deps in graph.items() if "agentrl.driver.trainer" in deps}
    assert importers_of_trainer <= {"agentrl.driver.pipeline", "agentrl.trainer"}, importers_of_trainer
    # the run's fault handling (supervision) and its weight syncs (weights.sync) are parts of the
    # driver: the trainer composes them, and the loop's modes use the supervisor's waits
    parts = {"agentrl.driver.supervision": {"agentrl.driver.trainer", "agentrl.driver.loop", "agentrl.driver.fixed_lag"},
             "agentrl.weights.sync": {"agentrl.driver.trainer"}}
    for part, users in parts.items():
        importers = {m for m, deps in graph.items() if part in deps}
        assert importers <= users, (part, importers)
    may_use_ray = MODULE_LEVEL["ray"]
    for name, path in modules.items():
        external = _external_imports(path)
        if not (name.startswith("agentrl.actors") or name in may_use_ray):
            assert "ray" not in external, f"{path.relative_to(REPO)} imports Ray"
        top = _external_imports(path, module_level=True)
        for heavy, allowed in MODULE_LEVEL.items():
            assert heavy not in top or name in allowed, f"{path.relative_to(REPO)} imports {heavy} at module level"
        if name.startswith("agentrl.envs"):
            assert not {"ray", "vllm"} & external, f"{path.relative_to(REPO)} imports Ray or vLLM"
            assert not {m for m in graph[name] if not m.startswith(("agentrl.envs", "agentrl.rollout.tool_calls",
                                                                      "agentrl.rollout.chat"))}, name
    for heavy, allowed in MODULE_LEVEL.items():
        gone = {m for m in allowed if heavy not in _external_imports(modules[m], module_level=True)}
        assert not gone, f"no longer import {heavy} at module level; remove from MODULE_LEVEL: {gone}"
    # Model loading has one home: the driver, SFT, eval and the learners reach it there.
    for user in ("agentrl.driver.trainer", "agentrl.driver.pipeline", "agentrl.driver.sft",
                 "agentrl.driver.evaluate", "agentrl.learner.torch_learner"):
        assert "agentrl.model.loading" in graph[user], user
    assert "agentrl.learner.optim" in graph["agentrl.model.tiny"] and "agentrl.driver.sft" not in graph["agentrl.model.tiny"]


def test_role_packages_import_nothing_heavy():
    """Importing a role package, or its light modules, starts neither Ray, vLLM nor Megatron-Core:
    the packages' ``__init__`` re-export lazily what would."""
    code = ("import sys\n"
            "import agentrl.config, agentrl.env, agentrl.rollout, agentrl.rollout.agent, agentrl.engine\n"
            "import agentrl.weights, agentrl.replay, agentrl.learner, agentrl.learner.megatron, agentrl.model\n"
            "import agentrl.driver, agentrl.driver.watchdog, agentrl.rollout.tool_calls, agentrl.weights.transports\n"
            "print(sorted(m for m in ('ray', 'vllm', 'megatron', 'torch') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


def _package_exports(init: Path) -> dict[str, str] | None:
    """A lazy package's ``_EXPORTS`` (name -> submodule), read from its ``__init__``; None if eager."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _module_all(path: Path) -> set[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def test_lazy_reexports_name_what_their_modules_export():
    lazy = {}
    for init in sorted((REPO / "agentrl").rglob("__init__.py")):
        exports = _package_exports(init)
        if exports is None:
            continue
        lazy[init.parent.name] = exports
        for name, sub in exports.items():
            assert name in _module_all(init.parent / f"{sub}.py"), f"{init.relative_to(REPO)}: {name} not in {sub}.__all__"
    assert {"rollout", "agent", "engine", "weights", "driver", "model"} <= set(lazy)


def test_lazy_reexport_is_the_module_attribute():
    import agentrl.rollout
    from agentrl.rollout.episode import run_episode

    assert "run_episode" in dir(agentrl.rollout)
    assert agentrl.rollout.run_episode is run_episode
    with pytest.raises(AttributeError, match="no_such_name"):
        agentrl.rollout.no_such_name  # noqa: B018


def test_kept_import_paths_reexport_their_home():
    import importlib

    from agentrl.docs import KEPT_PATH, api_modules

    modules = package_modules()
    kept = {m for m, path in modules.items() if (ast.get_docstring(ast.parse(path.read_text())) or "").startswith(KEPT_PATH)}
    assert kept == set(KEPT_PATHS)
    for old, new in KEPT_PATHS.items():
        old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
        assert old_mod.__all__ == new_mod.__all__
        assert all(getattr(old_mod, n) is getattr(new_mod, n) for n in new_mod.__all__), old
        assert new in (old_mod.__doc__ or "")
    assert not set(KEPT_PATHS) & set(api_modules()), "a kept path would duplicate its home's API page"


def test_pyproject_lists_every_package():
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {".".join([pkg, *init.parent.relative_to(REPO / folder).parts])
                for pkg, folder in setuptools["package-dir"].items() if pkg == "agentrl"
                for init in (REPO / folder).rglob("__init__.py")}
    packages |= set(setuptools["package-dir"]) - {"agentrl"}
    assert sorted(setuptools["packages"]) == sorted(packages)


def _external_imports(path: Path, module_level: bool = False) -> set[str]:
    """Top-level names of what ``path`` imports: anywhere, or as it is imported (``module_level``:
    not in a function, nor under ``if TYPE_CHECKING:``)."""
    names = set()
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if not module_level else _module_level_nodes(tree.body)
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _module_level_nodes(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from _module_level_nodes(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            yield from _module_level_nodes(getattr(node, field, None) or [])


@pytest.mark.parametrize("old, new", [
    ("agentrl.driver.trainer:resolve_model_path", "agentrl.model.loading:resolve_model_path"),
    ("agentrl.driver.sft:plateau_schedule", "agentrl.learner.optim:plateau_schedule"),
    ("agentrl.trainer:resolve_model_path", "agentrl.model.loading:resolve_model_path"),  # a kept path
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


@pytest.mark.parametrize("module", ["agentrl.model.loading", "agentrl.learner.optim", "agentrl.driver.progress",
                                    "agentrl.learner.lora", "agentrl._lazy", "agentrl.weights.store"])
def test_doctests(module):
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted and not result.failed


def test_every_agentrl_import_names_a_module():
    """Imports of agentrl anywhere in the repository name modules that exist (an import of the flat
    layout's ``agentrl.losses`` fails here; ``scripts/rewrite_old_imports.py`` rewrites it)."""
    modules = package_modules()
    bad = []
    for folder in ("agentrl", "actors", "envs", "tests", "bench", "tools", "examples", "scripts"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
                bad += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                        if n.split(".")[0] == "agentrl" and n not in modules]
    assert not bad, "\n".join(bad)


def test_rewrite_of_old_imports():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rewrite_old_imports", REPO / "scripts" / "rewrite_old_imports.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = doctest.testmod(script)
    assert result.attempted and not result.failed
    # every old name maps onto a module or package that exists, and no new name is rewritten again
    modules = package_modules()
    assert set(script.MODULES.values()) <= set(modules)
    # old names that exist still: what became a package, and the kept import paths
    assert set(script.MODULES) & set(modules) == {"agentrl.rollout", "agentrl.replay", *KEPT_PATHS}
    for new in set(modules) - set(KEPT_PATHS):
        if not new.startswith(("agentrl.rollout", "agentrl.replay")):
            assert script.rewrite(f"import {new}") == f"import {new}", new
