"""Training on an env of one's own: `env.id=module:EnvId`, the README's example module, and bad env
settings reported by `agentrl train` before anything starts (no model, no SFT, no Ray)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import agentrl.envs  # noqa: F401  (built-ins registered at collection, before tests that pop what they register)
import gymnasium
import pytest

from agentrl.cli import main
from agentrl.config import ConfigError, load_config
from agentrl.env.ids import check_env, env_module_path, import_env_module, split_env_id

from .test_envs_readme_example import readme_example

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "units_env.py"
UNITS = "examples.units_env:my/Units-v0"


@pytest.fixture(autouse=True)
def isolated_imports(monkeypatch):
    """Each test imports user modules afresh, and what it registers or adds to sys.path goes away."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name == "examples" or name.startswith(("examples.", "user_")):
            del sys.modules[name]
    for env_id in [e for e in gymnasium.registry if e.startswith(("my/", "user/"))]:
        gymnasium.registry.pop(env_id)


def train_cli(tmp_path, capsys, *overrides: str) -> str:
    """`agentrl train configs/quickstart.yaml OVERRIDES`: must fail with exit code 2 before Ray starts
    and before the model is looked at (it does not exist); returns the error text."""
    argv = ["train", str(REPO / "configs/quickstart.yaml"), f"model.path={tmp_path / 'no-model'}",
            "model.bootstrap_tiny=false", f"run_dir={tmp_path / 'run'}", *overrides]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.path" not in err, "the env must be checked before the model"
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()
    return err


def test_example_module_is_the_readme_block():
    tree = ast.parse(EXAMPLE.read_text())
    assert ast.get_docstring(tree), "examples/units_env.py opens with a docstring"
    code = "".join(EXAMPLE.read_text().splitlines(keepends=True)[tree.body[0].end_lineno:]).lstrip("\n")
    assert code == readme_example()


def test_module_colon_id_makes_the_users_env():
    assert split_env_id(UNITS) == ("examples.units_env", "my/Units-v0")
    assert check_env(UNITS, {"max_turns": 3}) == "my/Units-v0"
    env = gymnasium.make("my/Units-v0", max_turns=3)
    messages, info = env.reset(seed=0)
    assert "miles" in messages[0]["content"] and [t["function"]["name"] for t in info["tools"]] == ["to_km"]
    env.close()


def test_module_found_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "user_envs.py").write_text(EXAMPLE.read_text().replace("my/Units-v0", "user/Units-v0"))
    monkeypatch.chdir(tmp_path)
    sys.path[:] = [p for p in sys.path if p not in ("", str(tmp_path))]
    assert import_env_module("user_envs:user/Units-v0") == "user/Units-v0"
    assert "user/Units-v0" in gymnasium.registry
    assert env_module_path("user_envs:user/Units-v0") == (tmp_path / "user_envs.py").resolve()


def test_env_module_path_ships_only_what_is_not_installed():
    assert env_module_path("agentrl/Calculator-v0") is None
    assert env_module_path("agentrl.envs:agentrl/Calculator-v0") is None  # installed: the nodes have it
    assert env_module_path("json:agentrl/Calculator-v0") is None  # standard library
    import_env_module(UNITS)
    assert env_module_path(UNITS) == REPO / "examples"  # the top-level package: `import examples...`


def test_unknown_env_id_is_reported_with_gymnasiums_suggestion(tmp_path, capsys):
    err = train_cli(tmp_path, capsys, "env.id=agentrl/Calculater-v0")
    assert "env.id" in err and "Did you mean: `Calculator`?" in err
    err = train_cli(tmp_path, capsys, "env.id=my/Units-v0")  # registered by a module not named
    assert "env.id=<module>:my/Units-v0" in err
    err = train_cli(tmp_path, capsys, "env.id=examples.units_env:my/Unit-v0")
    assert "Did you mean: `Units`?" in err and "module 'examples.units_env' was imported" in err


def test_module_that_does_not_import_is_reported(tmp_path, capsys, monkeypatch):
    err = train_cli(tmp_path, capsys, "env.id=user_no_such_module:my/X-v0")
    assert "env.id: module 'user_no_such_module'" in err and "was not found" in err
    (tmp_path / "user_broken.py").write_text("import gymnasium\n\nraise RuntimeError('tool server is down')\n")
    monkeypatch.chdir(tmp_path)
    err = train_cli(tmp_path, capsys, "env.id=user_broken:my/X-v0")
    assert "importing module 'user_broken'" in err and "RuntimeError: tool server is down" in err
    assert f"{tmp_path / 'user_broken.py'}:3" in err
    (tmp_path / "user_needs.py").write_text("import user_missing_dependency\n")
    err = train_cli(tmp_path, capsys, "env.id=user_needs:my/X-v0")
    assert "No module named 'user_missing_dependency'" in err and "user_needs.py:1" in err


def test_kwargs_the_env_rejects_are_reported(tmp_path, capsys):
    err = train_cli(tmp_path, capsys, "sft.enabled=false", f"env.id={UNITS}", "env.kwargs={max_turnz: 3}")
    assert "env.kwargs" in err and "max_turnz" in err and "did you mean 'max_turns'?" in err
    err = train_cli(tmp_path, capsys, "sft.enabled=false", f"env.id={UNITS}", "env.kwargs={max_turns: 0}")
    assert "env.kwargs: making 'my/Units-v0'" in err and "max_turns must be >= 1" in err


def test_sft_on_an_env_without_expert_is_reported(tmp_path, capsys):
    err = train_cli(tmp_path, capsys, f"env.id={UNITS}")  # the quickstart config has sft.enabled=true
    assert "sft.enabled" in err and "has none" in err


def test_sft_and_eval_commands_check_the_env_first(tmp_path, capsys, tiny_model_dir):
    cfg = ["configs/quickstart.yaml", f"model.path={tmp_path / 'no-model'}", f"env.id={UNITS}"]
    assert main(["sft", str(REPO / cfg[0]), *cfg[1:]]) == 2
    assert "has none" in capsys.readouterr().err
    assert main(["eval", "--model", tiny_model_dir, "--env", "agentrl/Calculater-v0"]) == 2
    err = capsys.readouterr().err
    assert "--env: 'agentrl/Calculater-v0' is not a registered env" in err and "Did you mean" in err


def test_runtime_env_typo_is_reported(tmp_path, capsys):
    err = train_cli(tmp_path, capsys, "sft.enabled=false", f"env.id={UNITS}", "cluster.runtime_env={py_modulez: [x]}")
    assert "cluster.runtime_env: unknown key 'py_modulez'; did you mean 'py_modules'?" in err


def test_runtime_env_gets_the_env_module():
    from agentrl.actors.runtime_env import build_runtime_env

    cfg = load_config(None, [f"env.id={UNITS}", "cluster.runtime_env={env_vars: {A: b}}"])
    import_env_module(cfg.env.id)
    assert build_runtime_env(cfg) == {"env_vars": {"A": "b"}, "py_modules": [str(REPO / "examples")]}
    cfg.cluster.ship_env_module = False
    assert build_runtime_env(cfg) == {"env_vars": {"A": "b"}}
    assert build_runtime_env(load_config(None, [])) == {}  # a built-in env ships nothing


@pytest.mark.parametrize("env_id, fix", [("envs/units.py:my/U-v0", "envs.units:my/U-v0"),
                                         ("a:b:my/U-v0", "module:EnvId (one ':')")])
def test_malformed_module_colon_id_is_a_config_error(env_id, fix):
    with pytest.raises(ConfigError, match="env.id") as info:
        load_config(None, [f"env.id={env_id}"])
    assert fix in str(info.value)
