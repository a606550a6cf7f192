"""The test tiers: `make test` (what CI runs) leaves out the tests marked `full`, which repeat a
path that another test runs end to end; `make test-all` runs them too. A path's last test in the
default tier marked `full` by mistake would leave CI without it and fail nothing, hence these
checks, read from the sources (no collection of the suite)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# path -> (file under tests/, test function, the parametrized case that stays in the default tier)
DEFAULT_TIER = {
    "train with refits": ("test_pipeline_e2e.py", "test_train_three_steps_with_refit", None),
    "resume": ("test_pipeline_e2e.py", "test_resume_continues_a_run_from_its_last_checkpoint", None),
    "engine death in a run": ("test_chaos.py", "test_frozen_engine_is_diagnosed_and_restarted", None),
    "engine restart": ("test_engine_actor.py", "test_restarted_engine_loads_current_weights_before_work", None),
    "endpoint over HTTP": ("test_endpoint_e2e.py", "test_openai_sdk_agent_exact_tokens_and_logprob_agreement", None),
    "training through the endpoint": ("test_endpoint_e2e.py", "test_train_three_steps_through_the_agents_sdk", 0),
    "LoRA": ("test_lora_e2e.py", "test_lora_training_refits_the_adapter_and_engine_matches_learner", "nccl"),
    "long context": ("test_long_context_e2e.py", "test_long_episode_with_a_refit_inside_trains_as_sampled", None),
    "chaos": ("test_chaos.py", "test_every_group_is_accounted_for_and_none_trained_twice", None),
    "stall detection": ("test_chaos_stall.py", "test_a_frozen_engine_core_is_found_by_its_progress_and_restarted", None),
    "distillation": ("test_distill.py", "test_train_with_a_teacher_and_dynamic_sampling", 3),
    "sandbox escape": ("test_sandbox_escape.py", "test_attack_is_contained", None),
    "docs": ("test_docs.py", "test_mkdocs_build_strict", None),
}


def _is_parametrize(d: ast.expr) -> bool:
    return isinstance(d, ast.Call) and ast.unparse(d.func).endswith("mark.parametrize")


def _marks(fn: ast.FunctionDef) -> str:
    """The function's own marks (a parametrized case's marks are its case's)."""
    return " ".join(ast.unparse(d) for d in fn.decorator_list if not _is_parametrize(d))


def _module(name: str) -> ast.Module:
    return ast.parse((REPO / "tests" / name).read_text())


def _module_marks(tree: ast.Module) -> str:
    return " ".join(ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets))


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _cases(fn: ast.FunctionDef) -> list[ast.expr]:
    for d in fn.decorator_list:
        if _is_parametrize(d) and isinstance(d.args[1], ast.List | ast.Tuple):
            return list(d.args[1].elts)
    return []


@pytest.mark.parametrize("path", list(DEFAULT_TIER))
def test_every_path_keeps_a_test_in_the_default_tier(path):
    name, func, case = DEFAULT_TIER[path]
    tree = _module(name)
    fn = _functions(tree).get(func)
    assert fn is not None, f"{path}: tests/{name} has no {func} (renamed? update DEFAULT_TIER)"
    assert "mark.full" not in _module_marks(tree) + " " + _marks(fn), f"{path}: {func} is marked full"
    if case is not None:
        kept = [c for c in _cases(fn) if isinstance(c, ast.Constant) and c.value == case]
        assert kept, f"{path}: {func}'s case {case!r} is gone or marked full"


def test_the_full_tier_holds_slow_tests_only():
    """A test that starts no Ray or vLLM is cheap enough for every CI run."""
    full = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module = _module_marks(tree)
        for fn in _functions(tree).values():
            marks = module + " " + _marks(fn)
            if "mark.full" in marks or any("mark.full" in ast.unparse(c) for c in _cases(fn)):
                full.append(fn.name)
                assert "mark.slow" in marks, f"{path.name}::{fn.name} is marked full but not slow"
    assert full, "no test is marked full: make test and make test-all run the same tests"


def test_make_test_leaves_out_the_full_tier_and_ci_runs_it():
    recipes = dict(re.findall(r"^([\w-]+):.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE))
    assert '-m "not full"' in recipes["test"] and "--durations=15" in recipes["test"]
    assert "-m '" not in recipes["test-all"] and '-m "' not in recipes["test-all"] and "--durations=15" in recipes["test-all"]
    assert "make test\n" in (REPO / ".ci" / "run").read_text()
    assert '"full: ' in (REPO / "pyproject.toml").read_text()
