"""Environments: ``TextEnv``, ``ToolEnv`` with ``@tool`` methods, a sandbox, per-episode workspaces, and eight built-in envs.

Importing this package registers the built-ins with Gymnasium::

    import gymnasium
    import agentrl.envs  # noqa: F401

    env = gymnasium.make("agentrl/Calculator-v0")
    messages, info = env.reset(seed=0)  # info["tools"]: JSON schemas for apply_chat_template
"""

from __future__ import annotations

import gymnasium

from agentrl.envs.base import MAX_ACTION_CHARS, ChatMessages, Message, TextEnv, ToolEnv, Turn
from agentrl.envs.calculator import CalculatorEnv
from agentrl.envs.coding import CodingEnv
from agentrl.envs.file_navigator import FileNavigatorEnv
from agentrl.envs.long_needle import LongNeedleEnv
from agentrl.envs.long_recall import LongRecallEnv
from agentrl.envs.python_sandbox import PythonSandboxEnv
from agentrl.envs.repo_fix import RepoFixEnv
from agentrl.envs.sandbox import BwrapUnavailableError, SandboxLimits, SandboxResult, run_sandboxed
from agentrl.envs.search import SearchEnv
from agentrl.envs.tools import ToolTimeoutError, tool
from agentrl.envs.wordle import WordleEnv
from agentrl.envs.workspace import CommandResult, Workspace, WorkspaceDied, WorkspaceLimits, make_tar

__all__ = [
    "BUILTIN_ENV_IDS",
    "BwrapUnavailableError",
    "MAX_ACTION_CHARS",
    "CalculatorEnv",
    "ChatMessages",
    "CodingEnv",
    "CommandResult",
    "FileNavigatorEnv",
    "LongNeedleEnv",
    "LongRecallEnv",
    "Message",
    "PythonSandboxEnv",
    "RepoFixEnv",
    "SandboxLimits",
    "SandboxResult",
    "SearchEnv",
    "TextEnv",
    "ToolEnv",
    "ToolTimeoutError",
    "Turn",
    "WordleEnv",
    "Workspace",
    "WorkspaceDied",
    "WorkspaceLimits",
    "make_tar",
    "run_sandboxed",
    "tool",
]

_BUILTINS = {
    "Calculator": "agentrl.envs.calculator:CalculatorEnv",
    "Search": "agentrl.envs.search:SearchEnv",
    "PythonSandbox": "agentrl.envs.python_sandbox:PythonSandboxEnv",
    "Wordle": "agentrl.envs.wordle:WordleEnv",
    "FileNavigator": "agentrl.envs.file_navigator:FileNavigatorEnv",
    "LongRecall": "agentrl.envs.long_recall:LongRecallEnv",
    "LongNeedle": "agentrl.envs.long_needle:LongNeedleEnv",
    "RepoFix": "agentrl.envs.repo_fix:RepoFixEnv",
}
BUILTIN_ENV_IDS = tuple(f"agentrl/{name}-v0" for name in _BUILTINS)

for _name, _entry_point in _BUILTINS.items():
    if f"agentrl/{_name}-v0" not in gymnasium.registry:  # re-imports must not warn about overriding
        gymnasium.register(id=f"agentrl/{_name}-v0", entry_point=_entry_point)
