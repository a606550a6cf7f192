"""Kept import path; the code lives in :mod:`agentrl.driver.trainer`."""

from agentrl.driver import trainer as _home
from agentrl.driver.trainer import *  # noqa: F403
from agentrl.driver.trainer import __all__  # noqa: F401


def __getattr__(name: str):
    return getattr(_home, name)  # the names it keeps for older imports, with their warnings
