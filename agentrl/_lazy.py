"""Lazy re-exports for the role packages' ``__init__``: a name is imported on first use.

A package's ``__init__`` runs whenever any of its modules is imported, so importing every module it
re-exports would make ``agentrl.driver.watchdog`` pay for Ray and ``agentrl.rollout.tool_calls``
(which the config imports) import the config back while it is still half-built.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of a package that re-exports ``name -> submodule``.

    Example:
        >>> getattr_, dir_ = lazy_exports("agentrl.replay", {"ReplayQueue": "queue"})
        >>> getattr_("ReplayQueue").__name__, "ReplayQueue" in dir_()
        ('ReplayQueue', True)
    """

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        setattr(sys.modules[package], name, value)  # found once, then a plain attribute
        return value

    def __dir__() -> list[str]:
        return sorted(set(exports) | set(importlib.import_module(package).__dict__))

    return __getattr__, __dir__
