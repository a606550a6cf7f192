"""Env ids as a config gives them: Gymnasium's ``[module:]EnvId`` form, resolved and checked.

``env.id=myenvs:my/Units-v0`` means "import ``myenvs`` (it registers ``my/Units-v0``), then make
``my/Units-v0``". :func:`import_env_module` does the import (from the Python path, else from the
current directory, as ``python -m`` would) and returns the bare id; :func:`check_env` also makes
the env once with its kwargs, so that an unknown id, a module that does not import, or kwargs the
env rejects are :class:`~agentrl.config.ConfigError` s before any actor starts;
:func:`env_module_path` names the file or package that must travel to other nodes of a cluster.

Knows nothing of Ray, vLLM or the trainer.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from agentrl.config.base import ConfigError

__all__ = ["check_env", "env_module_path", "import_env_module", "split_env_id"]


def split_env_id(env_id: str) -> tuple[str | None, str]:
    """``"pkg.mod:ns/Name-v0"`` -> ``("pkg.mod", "ns/Name-v0")``; an id without a module -> ``(None, id)``.

    Example:
        >>> split_env_id("examples.units_env:my/Units-v0")
        ('examples.units_env', 'my/Units-v0')
        >>> split_env_id("agentrl/Calculator-v0")
        (None, 'agentrl/Calculator-v0')
    """
    module, sep, name = env_id.partition(":")
    return (module, name) if sep else (None, env_id)


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing, or fails to import: the import says which
        return False


def _where(exc: BaseException) -> str:
    """`` (at file:line)`` of the innermost frame of ``exc``, or of the file a SyntaxError names."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    inner = [f for f in frames if "importlib" not in f.filename]
    return f" (at {inner[-1].filename}:{inner[-1].lineno})" if inner else ""


def import_env_module(env_id: str, *, key: str = "env.id") -> str:
    """Import the built-in envs and the module of ``env_id``; return the id without its module.

    The module is looked up on the Python path, then in the current directory (a user's
    ``myenvs.py`` beside the config works whether agentrl runs as a console script or with
    ``python -m``).

    Args:
        env_id: ``EnvId`` or ``module:EnvId``.
        key: the config key or option that gave ``env_id``, for error messages.

    Raises:
        ConfigError: the module is not found, or importing it raises.
    """
    import agentrl.envs  # noqa: F401  (registers the built-in envs)

    module, name = split_env_id(env_id)
    if module is None or module in sys.modules:
        return name
    cwd = os.getcwd()
    if not _findable(module) and cwd not in sys.path:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise ConfigError(
                f"{key}: module '{module}' (of '{env_id}') was not found on the Python path nor in the "
                f"current directory {cwd}. Run from the directory that holds "
                f"{module.replace('.', '/')}.py, add that directory to PYTHONPATH, or install the package."
            ) from None
        raise ConfigError(f"{key}: importing module '{module}' (of '{env_id}') failed: "
                          f"{type(exc).__name__}: {exc}{_where(exc)}") from None
    except Exception as exc:  # noqa: BLE001  (the user's module may raise anything: name it and where)
        raise ConfigError(f"{key}: importing module '{module}' (of '{env_id}') failed: "
                          f"{type(exc).__name__}: {exc}{_where(exc)}") from None
    return name


def _unknown_id_message(env_id: str, name: str, module: str | None, exc: Exception) -> str:
    import gymnasium

    msg = f"'{env_id}' is not a registered env: {exc}"
    suggested = "Did you mean" in str(exc)
    if not suggested:
        close = difflib.get_close_matches(name, list(gymnasium.registry), n=1, cutoff=0.6)
        if close:
            msg += f" Did you mean `{close[0]}`?"
            suggested = True
    if module is not None:
        msg += f" (module '{module}' was imported but did not register '{name}')"
    elif not suggested:
        msg += (" If a module of yours registers it, name the module too: "
                f"env.id=<module>:{name} (e.g. examples.units_env:my/Units-v0)")
    return msg


def _find_spec(env_id: str, name: str, module: str | None, key: str) -> Any:
    """The EnvSpec ``gymnasium.make(name)`` would use (an unversioned id means its latest version)."""
    import gymnasium
    from gymnasium.envs.registration import find_highest_version, get_env_id, parse_env_id

    try:
        ns, base, version = parse_env_id(name)
        if version is None and (latest := find_highest_version(ns, base)) is not None:
            return gymnasium.spec(get_env_id(ns, base, latest))
        return gymnasium.spec(name)
    except gymnasium.error.Error as exc:
        raise ConfigError(f"{key}: {_unknown_id_message(env_id, name, module, exc)}") from None


def _kwargs_message(entry_point: Any, exc: TypeError) -> str:
    """Gymnasium's TypeError for a rejected keyword, with the accepted ones and a close match."""
    msg = f"{type(exc).__name__}: {exc}"
    try:
        creator = entry_point
        if isinstance(creator, str):
            from gymnasium.envs.registration import load_env_creator

            creator = load_env_creator(creator)
        params = inspect.signature(creator).parameters
    except (TypeError, ValueError, ImportError, AttributeError):
        return msg
    accepted = [p.name for p in params.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    bad = re.search(r"keyword argument '(\w+)'", str(exc))
    if bad and accepted:
        hint = difflib.get_close_matches(bad.group(1), accepted, n=1)
        msg += f"; did you mean '{hint[0]}'?" if hint else ""
        msg += f" (accepted: {', '.join(accepted)})"
    return msg


def check_env(env_id: str, kwargs: dict[str, Any] | None = None, *, key: str = "env.id",
              kwargs_key: str = "env.kwargs", need_expert: bool = False) -> str:
    """Make ``env_id`` once with ``kwargs`` and close it; return the id without its module.

    Args:
        env_id: ``EnvId`` or ``module:EnvId``.
        kwargs: keyword arguments for ``gymnasium.make``.
        key, kwargs_key: the config keys (or options) that gave them, for error messages.
        need_expert: the env must have an ``expert(seed, ...)`` demonstrator (SFT is on).

    Raises:
        ConfigError: the module does not import, the id is not registered (with Gymnasium's
            did-you-mean), the env rejects ``kwargs``, or it has no expert when one is needed.

    Example:
        >>> check_env("agentrl/Calculator-v0", {"max_turns": 3})
        'agentrl/Calculator-v0'
    """
    import gymnasium

    kwargs = dict(kwargs or {})
    name = import_env_module(env_id, key=key)
    module = split_env_id(env_id)[0]
    spec = _find_spec(env_id, name, module, key)
    try:
        env = gymnasium.make(name, **kwargs)
    except TypeError as exc:
        where = kwargs_key if kwargs else key
        raise ConfigError(f"{where}: '{name}' rejected the keyword arguments {kwargs}: "
                          f"{_kwargs_message(spec.entry_point, exc)}") from None
    except Exception as exc:  # noqa: BLE001  (the env's constructor: a bad kwarg value, a missing resource)
        where = kwargs_key if kwargs else key
        raise ConfigError(f"{where}: making '{name}' with {kwargs or 'no keyword arguments'} failed: "
                          f"{type(exc).__name__}: {exc}{_where(exc)}") from None
    try:
        if need_expert and getattr(env.unwrapped, "expert", None) is None:
            raise ConfigError(
                f"sft.enabled: SFT (the warm start, `agentrl sft`) learns from the env's expert(seed) "
                f"demonstrator, and '{name}' has none: train with sft.enabled=false (RL from the start), "
                "or give the env an `expert` method")
    finally:
        env.close()
    return name


def _installed(top: str, path: Path) -> bool:
    if top in sys.stdlib_module_names or top in importlib.metadata.packages_distributions():
        return True
    return "site-packages" in path.parts or "dist-packages" in path.parts


def env_module_path(env_id: str) -> Path | None:
    """The file or package directory that brings the module of ``env_id`` to another machine.

    None when the id names no module, or when the module belongs to an installed distribution
    (including the standard library and agentrl itself): the nodes have those already. Otherwise
    the top-level package (or single-file module) the module lives in: that is what a Ray
    ``runtime_env``'s ``py_modules`` entry ships and puts on the workers' path. Call it after
    :func:`import_env_module`.

    Raises:
        ConfigError: the module is spread over several directories (a namespace package), which
            Ray cannot ship as one entry.
    """
    module = split_env_id(env_id)[0]
    if module is None:
        return None
    top = module.split(".")[0]
    mod = sys.modules.get(top) or importlib.import_module(top)
    # one directory may appear twice (sys.path can hold both '' and the same directory by name)
    paths = list(dict.fromkeys(os.path.realpath(p) for p in (getattr(mod, "__path__", []) or [])))
    if paths:
        if len(paths) > 1:
            raise ConfigError(
                f"env.id: package '{top}' spans several directories ({', '.join(paths)}); Ray ships one "
                "directory per entry: set cluster.ship_env_module=false and list them in "
                "cluster.runtime_env.py_modules")
        path = Path(paths[0]).resolve()
    elif getattr(mod, "__file__", None):
        path = Path(mod.__file__).resolve()
    else:  # built into the interpreter
        return None
    return None if _installed(top, path) else path
