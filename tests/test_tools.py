"""tools/ holds diagnostics, bench/ benchmarks: each diagnostic says which question it answers."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = sorted(p for p in (REPO / "tools").glob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: p.name)
def test_each_diagnostic_opens_with_its_question(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.split("\n\n")[0].splitlines()[0] if doc else ""
    assert first.startswith("Question: ") and first.rstrip().endswith("?"), (
        f"{path.name}: the docstring's first line should be 'Question: ...?', got {first!r}")


def test_the_diagnostics_left_bench():
    moved = {"calculator_diag.py", "sft_copy_diag.py", "slow_envs.py", "learner_step.py", "megatron_check.py"}
    assert not moved & {p.name for p in (REPO / "bench").glob("*.py")}
    assert moved <= {p.name for p in TOOLS}


def test_the_slow_env_of_the_async_benchmark_imports_by_its_id(monkeypatch):
    import gymnasium

    from agentrl.env.ids import env_module_path, import_env_module

    monkeypatch.chdir(REPO)
    name = import_env_module("tools.slow_envs:SlowCalculator-v0")
    env = gymnasium.make(name)
    env.close()
    assert env_module_path("tools.slow_envs:SlowCalculator-v0") == REPO / "tools"  # what Ray ships
