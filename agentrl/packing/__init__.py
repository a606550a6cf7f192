"""Kept import path; the code lives in :mod:`agentrl.learner.packing`."""

from agentrl.learner.packing import *  # noqa: F403
from agentrl.learner.packing import __all__  # noqa: F401
