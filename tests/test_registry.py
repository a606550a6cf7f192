"""The open registries (agentrl/config/registry.py): register, duplicates, did-you-mean, ``module:name``
imports and their errors, and the three config keys that select from them."""

from __future__ import annotations

import sys
import textwrap

import pytest

from agentrl.config import ConfigError, load_config
from agentrl.config.registry import (
    ADVANTAGE_ESTIMATORS,
    LEARNERS,
    LOSSES,
    Registry,
    RegistryError,
    check_components,
)



pytestmark = pytest.mark.usefixtures("isolated_registries")


def user_module(tmp_path, monkeypatch, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)  # found in the current directory, as a user's module beside the config
    return name


def test_register_get_and_names():
    reg = Registry("greeting", "greet.type")
    reg.register("hi", str.upper)

    @reg.register("hello")
    def hello():
        return "hello"

    assert reg.names() == ["hi", "hello"] and list(reg) == ["hi", "hello"] and len(reg) == 2
    assert reg["hello"] is hello and reg.resolve("hi") is str.upper
    assert "hello" in reg and "bye" not in reg
    reg.unregister("hi")
    assert reg.names() == ["hello"]


def test_duplicate_name_is_an_error_but_the_same_object_again_is_not():
    reg = Registry("greeting", "greet.type")

    def one():
        return 1

    reg.register("x", one)
    reg.register("x", one)  # a module imported twice registers the same thing again
    with pytest.raises(RegistryError, match=r"greeting 'x' is already registered \(by .*test_registry\)"):
        reg.register("x", lambda: 2)
    with pytest.raises(RegistryError, match="already registered"):
        LOSSES.register("ppo", lambda *a, **k: None)  # a built-in's name stays the built-in's
    reg.register("y", lambda: 1)
    with pytest.raises(RegistryError, match="already registered"):  # lambdas share a qualname
        reg.register("y", lambda: 2)
    for bad in ("", "a:b", " x"):
        with pytest.raises(RegistryError, match="non-empty string without ':'"):
            reg.register(bad, one)


def test_unknown_names_get_a_did_you_mean_naming_the_config_key():
    reg = Registry("greeting", "greet.type")
    reg.register("hello", str)
    with pytest.raises(ConfigError, match=r"^unknown greeting 'helo'; did you mean 'hello'\? \(known: hello"):
        reg.check("helo")
    with pytest.raises(ConfigError, match=r"^greet.type: unknown greeting 'helo'; did you mean 'hello'"):
        reg.resolve("helo")
    with pytest.raises(ConfigError, match=r"^other.key: unknown greeting 'zzz' \(known"):
        reg.resolve("zzz", key="other.key")
    assert reg.check("any_mod:any_name") == "any_mod:any_name"  # imported when the run starts
    with pytest.raises(ConfigError, match="neither a greeting name nor <module>:<name>"):
        reg.check("mod:")


@pytest.mark.parametrize("key, value, hint", [
    ("loss.type", "ppoo", "ppo"),
    ("advantage.estimator", "rlo", "rloo"),
    ("learner.backend", "megatrom", "megatron"),
])
def test_config_rejects_an_unknown_built_in_name(key, value, hint):
    with pytest.raises(ConfigError, match=rf"{key}: .*unknown .* '{value}'; did you mean '{hint}'"):
        load_config(None, [f"{key}={value}"])


def test_built_ins_are_registered_lazily_with_their_traits():
    assert LOSSES.names() == ["ppo"] and ADVANTAGE_ESTIMATORS.names() == ["grpo", "rloo", "dr_grpo"]
    assert LEARNERS.names() == ["torch", "megatron"]
    assert LEARNERS.meta("megatron")["distributed"] and not LEARNERS.meta("torch")["distributed"]
    assert LEARNERS.meta("torch")["lora"] and not LEARNERS.meta("megatron")["lora"]
    from agentrl.learner.losses import compute_policy_loss

    assert LOSSES["ppo"] is compute_policy_loss
    reg = Registry("thing", "thing.type")
    reg.register("later", "no_such_module_anywhere:thing", flag=True)
    assert reg.meta("later") == {"flag": True}  # read without importing
    with pytest.raises(ModuleNotFoundError):
        reg["later"]


def test_module_name_resolves_what_the_module_registers_or_defines(tmp_path, monkeypatch):
    mod = user_module(tmp_path, monkeypatch, "user_losses", """
        from agentrl.learner.losses import register_loss

        @register_loss("registered_name")
        def some_function(logprobs, prox, behavior, adv, mask, cfg, **kw):
            return "registered"

        def plain(logprobs, prox, behavior, adv, mask, cfg, **kw):
            return "plain"
    """)
    assert LOSSES.resolve(f"{mod}:registered_name")(*[None] * 6) == "registered"
    assert LOSSES.resolve(f"{mod}:plain")(*[None] * 6) == "plain"
    assert "registered_name" in LOSSES.names()
    assert LOSSES.meta(f"{mod}:registered_name") == {"advantage_factor": False}
    assert LOSSES.meta(f"{mod}:plain") == {}
    first = LOSSES["registered_name"]
    del sys.modules[mod]  # imported anew (a Ray worker reusing the process, a test): no clash
    assert LOSSES.resolve(f"{mod}:registered_name") is not first


def test_module_name_errors_name_the_key(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "user_broken", "import math\nraise RuntimeError('boom')\n")
    user_module(tmp_path, monkeypatch, "user_has_cispo", "def cispo(*a, **k):\n    return 0\n")
    with pytest.raises(ConfigError, match=r"loss.type: module 'user_nowhere' .*was not found on the Python path"):
        LOSSES.resolve("user_nowhere:x")
    with pytest.raises(ConfigError, match=r"advantage.estimator: importing module 'user_broken' .*failed: "
                                          r"RuntimeError: boom \(at .*user_broken.py:2\)"):
        ADVANTAGE_ESTIMATORS.resolve("user_broken:x")
    with pytest.raises(ConfigError, match=r"loss.type: module 'user_has_cispo' .*neither registers a policy loss "
                                          r"'cipso' nor defines it; did you mean 'user_has_cispo:cispo'"):
        LOSSES.resolve("user_has_cispo:cipso")


def test_check_components_fails_before_any_actor(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "user_parts", """
        def two_args(logprobs, cfg):
            return 0

        NOT_CALLABLE = 3

        class Learner:
            def __init__(self, cfg, **kwargs):
                pass
    """)
    check_components(load_config(None, ["loss.type=user_parts:two_args", "loss.type=ppo"]))  # built-ins pass
    with pytest.raises(ConfigError, match=r"loss.type: 'user_parts:two_args' does not take the arguments"):
        check_components(load_config(None, ["loss.type=user_parts:two_args"]))
    with pytest.raises(ConfigError, match=r"advantage.estimator: 'user_parts:NOT_CALLABLE' names int 3"):
        check_components(load_config(None, ["advantage.estimator=user_parts:NOT_CALLABLE"]))
    # an unregistered backend claims nothing: a LoRA run is refused before it starts
    cfg = load_config(None, ["learner.backend=user_parts:Learner", "learner.lora.rank=4"])
    with pytest.raises(ConfigError, match=r"learner.lora needs a backend that trains LoRA .*'user_parts:Learner'"):
        check_components(cfg)
    with pytest.raises(ConfigError, match="learner.lora needs"):  # a built-in's traits: when read
        load_config(None, ["learner.backend=megatron", "learner.lora.rank=4"])
