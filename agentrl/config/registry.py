"""Open registries by name: the policy loss, the advantage estimator and the learner backend.

A config selects each of them by name: a built-in one by its bare name (``loss.type: ppo``), one of
the user's by ``module:name`` (``loss.type: my_losses:clipped_sum``), the same form as
``env.id=examples.units_env:my/Units-v0``. The module is imported the way env modules are
(:func:`agentrl.env.ids.import_env_module`: the Python path, else the current directory) in every
process that needs the object, and it travels to the nodes of a cluster with the env's module
(:mod:`agentrl.actors.runtime_env`). ``name`` is what the module registered
(``@register_loss("clipped_sum")``) or, failing that, one of its attributes.

A built-in is registered as a ``"module:attribute"`` string, imported on first use: validating a
config imports neither torch nor Megatron. Bare names are checked when the config is read;
``module:name`` when a run starts (:func:`check_components`), before any actor.

Knows nothing of Ray, vLLM or the trainer.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

from agentrl.config.base import ConfigError

if TYPE_CHECKING:
    from agentrl.config import Config

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LEARNERS",
    "LOSSES",
    "Registry",
    "RegistryError",
    "check_components",
    "learner_capability_errors",
    "register_advantage_estimator",
    "register_learner",
    "register_loss",
]

T = TypeVar("T")


class RegistryError(ValueError):
    """A name registered twice, or a name a registry cannot hold."""


@dataclass
class _Entry:
    target: Any  # the object, or "module:attribute" until first use
    origin: str  # the module that registered it
    meta: dict[str, Any] = field(default_factory=dict)


def _origin(target: Any) -> str:
    if isinstance(target, str):
        return target.partition(":")[0]
    return getattr(target, "__module__", None) or "?"


def _same(a: Any, b: Any) -> bool:
    # A module imported anew (importlib.reload, or after it was removed from sys.modules) registers
    # new objects of the same definitions: that is not a clash. Lambdas and local functions share
    # qualnames, so only the same object is the same for them.
    if a is b or (isinstance(a, str) and a == b):
        return True
    qualname = getattr(a, "__qualname__", None)
    if not isinstance(qualname, str) or "<" in qualname:
        return False
    return (getattr(a, "__module__", None), qualname) == (getattr(b, "__module__", None),
                                                          getattr(b, "__qualname__", None))


class Registry(Mapping[str, T], Generic[T]):
    """Objects of one kind by name, selected by the config key ``key``.

    A :class:`~collections.abc.Mapping`: ``registry[name]`` is the object (a built-in registered as
    ``"module:attribute"`` is imported then), iteration gives the names in registration order.

    Example:
        >>> reg = Registry("greeting", "greet.type")
        >>> @reg.register("hello")
        ... def hello() -> str:
        ...     return "hi"
        >>> reg.resolve("hello")()
        'hi'
        >>> reg.check("helo")
        Traceback (most recent call last):
        ...
        agentrl.config.base.ConfigError: unknown greeting 'helo'; did you mean 'hello'? (known: hello; one of your own: <module>:<name>)
    """

    def __init__(self, kind: str, key: str) -> None:
        self.kind, self.key = kind, key
        self._entries: dict[str, _Entry] = {}

    @overload
    def register(self, name: str, target: None = None, **meta: Any) -> Callable[[T], T]: ...
    @overload
    def register(self, name: str, target: T | str, **meta: Any) -> T | str: ...

    def register(self, name: str, target: Any = None, **meta: Any) -> Any:
        """Register ``target`` (an object, or ``"module:attribute"`` imported on first use) as ``name``.

        Without ``target``, a decorator: ``@registry.register("name")``. ``meta`` holds what the
        users of the registry ask about an entry (:meth:`meta`) without importing it.

        Raises:
            RegistryError: ``name`` is empty, holds ``:``, or is taken by another object.
        """
        if target is None:
            def decorator(obj: T) -> T:
                self.register(name, obj, **meta)
                return obj
            return decorator
        if not isinstance(name, str) or not name or ":" in name or name != name.strip():
            raise RegistryError(f"a {self.kind} name must be a non-empty string without ':' or surrounding "
                                f"spaces, got {name!r} (':' separates a module from a name in {self.key})")
        old = self._entries.get(name)
        if old is not None and not _same(old.target, target):
            raise RegistryError(
                f"{self.kind} '{name}' is already registered (by {old.origin}); register yours under "
                f"another name, or unregister('{name}') first")
        self._entries[name] = _Entry(target, _origin(target), dict(meta))
        return target

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a test's clean-up; a built-in stays removed for the process)."""
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, name: str) -> T:
        entry = self._entries[name]
        if isinstance(entry.target, str):
            module, _, attr = entry.target.partition(":")
            entry.target = getattr(importlib.import_module(module), attr)
        return entry.target

    def _unknown(self, name: str) -> str:
        hint = difflib.get_close_matches(name, self.names(), n=1)
        msg = f"unknown {self.kind} '{name}'" + (f"; did you mean '{hint[0]}'?" if hint else "")
        return msg + f" (known: {', '.join(self.names())}; one of your own: <module>:<name>)"

    def check(self, spec: str) -> str:
        """Check ``spec`` as the config is read, importing nothing: a bare name must be registered
        (else a did-you-mean), ``module:name`` must have both parts. Returns ``spec``.

        Raises:
            ConfigError: the message is meant to follow the config path (pydantic prefixes it).
        """
        module, sep, name = spec.partition(":")
        if sep:
            if not module or not name or ":" in name:
                raise ConfigError(f"'{spec}' is neither a {self.kind} name nor <module>:<name>")
            return spec
        if spec not in self._entries:
            raise ConfigError(self._unknown(spec))
        return spec

    def _lookup(self, spec: str, key: str) -> tuple[Any, dict[str, Any]]:
        from agentrl.env.ids import import_env_module

        module_name, sep, _ = spec.partition(":")
        if not sep:
            if spec not in self._entries:
                raise ConfigError(f"{key}: {self._unknown(spec)}")
            return self[spec], self._entries[spec].meta
        self.check(spec)
        name = import_env_module(spec, key=key)
        entry = self._entries.get(name)
        if entry is not None and entry.origin == module_name:
            return self[name], entry.meta
        module = sys.modules[module_name]
        if hasattr(module, name):
            return getattr(module, name), {}
        own = [n for n, e in self._entries.items() if e.origin == module_name]
        public = own + [n for n in vars(module) if not n.startswith("_") and n not in own]
        hint = difflib.get_close_matches(name, public, n=1)
        raise ConfigError(
            f"{key}: module '{module_name}' (of '{spec}') was imported but neither registers a {self.kind} "
            f"'{name}' nor defines it" + (f"; did you mean '{module_name}:{hint[0]}'?" if hint else "")
            + (f" (it registers: {', '.join(own)})" if own else ""))

    def resolve(self, spec: str, *, key: str | None = None) -> T:
        """The object ``spec`` names: a registered name, or ``module:name`` (the module is imported
        first; ``name`` is what it registered, else its attribute).

        Raises:
            ConfigError: naming ``key`` (default: this registry's config key): an unknown name
                (with a did-you-mean), a module that is not found or fails to import, a module
                without ``name``.
        """
        return self._lookup(spec, key or self.key)[0]

    def meta(self, spec: str, *, key: str | None = None) -> dict[str, Any]:
        """What ``spec``'s entry was registered with (empty for an unregistered module attribute).
        A bare name is answered without importing anything."""
        if ":" not in spec and spec in self._entries:
            return self._entries[spec].meta
        return self._lookup(spec, key or self.key)[1]


LOSSES: Registry[Callable[..., Any]] = Registry("policy loss", "loss.type")
"""``loss.type``: functions with the signature of :func:`agentrl.learner.losses.compute_policy_loss`."""

ADVANTAGE_ESTIMATORS: Registry[Callable[..., Any]] = Registry("advantage estimator", "advantage.estimator")
"""``advantage.estimator``: ``(returns [G], normalize_std, eps, std) -> (baseline [G], scale [G])``."""

LEARNERS: Registry[Callable[..., Any]] = Registry("learner backend", "learner.backend")
"""``learner.backend``: classes ``(cfg, *, model_path, **rank_kwargs)`` of the
:class:`agentrl.learner.base.Learner` contract."""


def register_loss(name: str, fn: Callable[..., Any] | None = None, *, advantage_factor: bool = False) -> Any:
    """Register a policy loss as ``name`` (decorator without ``fn``); select it with
    ``loss.type: <module>:<name>``.

    The loss takes the arguments of :func:`agentrl.learner.losses.compute_policy_loss` (plain ``[B, T]``
    tensors and the ``loss`` config section) and returns ``(scalar loss, {"train/...": tensor})``.
    ``advantage_factor=True`` declares that every term of the loss is a token's advantage times
    something, so the learner may skip sequences whose advantages are all 0 (their loss and
    gradient are exactly 0); leave it False when in doubt.
    """
    return LOSSES.register(name, fn, advantage_factor=advantage_factor)


def register_advantage_estimator(name: str, fn: Callable[..., Any] | None = None) -> Any:
    """Register an advantage estimator as ``name`` (decorator without ``fn``); select it with
    ``advantage.estimator: <module>:<name>``. It maps a group's returns to a baseline and a scale:
    ``(returns [G], normalize_std, eps, std) -> (baseline [G], scale [G])``, ``A = (x - baseline) / scale``."""
    return ADVANTAGE_ESTIMATORS.register(name, fn)


def register_learner(name: str, cls: Any = None, *, distributed: bool = False, lora: bool = False,
                     dense_distill: bool = False) -> Any:
    """Register a learner backend as ``name`` (decorator without ``cls``); select it with
    ``learner.backend: <module>:<name>``.

    Args:
        cls: built as ``cls(cfg, model_path=..., **rank_kwargs)``; it follows
            :class:`agentrl.learner.base.Learner`.
        distributed: one actor per learner GPU (``learner.num_gpus``) in a torch.distributed group,
            each built with ``rank``, ``world_size``, ``local_rank``, ``master_addr`` and
            ``master_port``; False: a single actor (on one GPU if ``learner.num_gpus`` > 0).
        lora: it trains ``learner.lora`` adapters.
        dense_distill: it computes the dense top-k distillation loss (``distill.top_k`` > 0).
    """
    return LEARNERS.register(name, cls, distributed=distributed, lora=lora, dense_distill=dense_distill)


# The built-ins, as "module:attribute" (imported on first use: reading a config imports no torch).
register_loss("ppo", "agentrl.learner.losses:compute_policy_loss", advantage_factor=True)
register_advantage_estimator("grpo", "agentrl.learner.advantages:_grpo")
register_advantage_estimator("rloo", "agentrl.learner.advantages:_rloo")
register_advantage_estimator("dr_grpo", "agentrl.learner.advantages:_dr_grpo")
register_learner("torch", "agentrl.learner.torch_learner:TorchLearner", lora=True, dense_distill=True)
register_learner("megatron", "agentrl.learner.megatron.learner:MegatronLearner", distributed=True)


def learner_capability_errors(cfg: Config, traits: Mapping[str, Any]) -> list[str]:
    """What ``cfg`` asks of its learner backend that the backend (its registered ``traits``) lacks."""
    backend = cfg.learner.backend
    errors = []
    if cfg.learner.lora.enabled and not traits.get("lora"):
        errors.append(f"learner.lora needs a backend that trains LoRA adapters (learner.backend=torch); "
                      f"'{backend}' does not (set learner.backend=torch, or learner.lora.rank=0 for full "
                      "fine-tuning)")
    if cfg.distill.enabled and cfg.distill.top_k > 0 and not traits.get("dense_distill"):
        errors.append(f"distill.top_k > 0 (dense top-k distillation) needs learner.backend=torch: "
                      f"'{backend}' scores the sampled tokens only (set distill.top_k=0)")
    return errors


_LOSS_CALL = ((None,) * 6, {"ref_logprobs": None, "num_tokens": None, "num_sequences": None})


def check_components(cfg: Config) -> None:
    """Resolve ``loss.type``, ``advantage.estimator`` and ``learner.backend`` in this process (a
    user's module is imported) and check what can be checked without running them: call before
    any actor starts.

    Raises:
        ConfigError: naming the config key: a module that does not import or lacks the name, an
            object that is not callable, a loss that does not take the loss's arguments, a backend
            that lacks what the config asks of it.
    """
    for registry, spec in ((LOSSES, cfg.loss.type), (ADVANTAGE_ESTIMATORS, cfg.advantage.estimator),
                           (LEARNERS, cfg.learner.backend)):
        obj = registry.resolve(spec)
        if not callable(obj):
            raise ConfigError(f"{registry.key}: '{spec}' names {type(obj).__name__} {obj!r}, not a "
                              f"{registry.kind} (a function or class)")
    loss = LOSSES.resolve(cfg.loss.type)
    try:
        inspect.signature(loss).bind(*_LOSS_CALL[0], **_LOSS_CALL[1])
    except TypeError as exc:
        raise ConfigError(
            f"loss.type: '{cfg.loss.type}' does not take the arguments of a policy loss (logprobs, "
            "prox_logprobs, behavior_logprobs, advantages, loss_mask, cfg, *, ref_logprobs, num_tokens, "
            f"num_sequences; see agentrl.learner.losses.compute_policy_loss): {exc}") from None
    except ValueError:  # no signature to read (a builtin): it is called as it is
        pass
    errors = learner_capability_errors(cfg, LEARNERS.meta(cfg.learner.backend))
    if errors:
        raise ConfigError("; ".join(errors))
