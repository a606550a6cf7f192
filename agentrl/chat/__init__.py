"""Kept import path; the code lives in :mod:`agentrl.rollout.chat`."""

from agentrl.rollout.chat import *  # noqa: F403
from agentrl.rollout.chat import __all__  # noqa: F401
