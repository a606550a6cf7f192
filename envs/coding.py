"""``CodingEnv``: a ``ToolEnv`` whose episode owns a :class:`~agentrl.envs.workspace.Workspace`.

The env gives the agent five tools over one sandboxed workspace that lives from ``reset`` to the end of the
episode: ``bash`` (a persistent shell), ``read_file``, ``write_file``, ``str_replace`` and ``list_dir``.
A subclass says what the repository is (``new_repo``) and how the final tree is graded (``grade``); the
base class does the rest:

- the episode ends when the agent answers without a tool call, or at ``max_turns`` (truncated);
  either way the final tree is archived (every process the agent left is killed first), the agent's
  sandbox is closed, and ``grade(tree)`` gives the reward;
- ``grade`` usually calls ``run_grader(tree, harness)``: a *fresh* workspace that the agent never touched,
  started from the archive, with the harness readable only there (``/.agentrl/hidden``);
- ``close()`` (and the next ``reset``) ends the sandbox; a crash or a killed worker ends it too.

Knows nothing of Ray or vLLM.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from agentrl.envs.base import Message, ToolEnv, Turn
from agentrl.envs.tools import tool
from agentrl.envs.workspace import CommandResult, Workspace, WorkspaceLimits

__all__ = ["CodingEnv"]


class CodingEnv(ToolEnv):
    """Base class of coding envs. Subclasses implement ``new_repo`` and ``grade``.

    Args:
        limits: the workspace's limits (per call and per episode).
        max_turns: steps before truncation (the tree is still graded).
        tools: the names of the tools the task offers, a subset of ``bash``, ``read_file``,
            ``write_file``, ``str_replace`` and ``list_dir`` (None: all five). Fewer tools make a shorter
            prompt (each schema is rendered into it); a call of a tool not offered gets an error.
        **kwargs: ``max_tool_calls_per_turn``, ``max_tool_output_chars``, ``tool_parser``.
    """

    def __init__(self, *, limits: WorkspaceLimits | None = None, max_turns: int = 16,
                 tools: Sequence[str] | None = None, **kwargs: Any) -> None:
        self.limits = limits or WorkspaceLimits()
        kwargs.setdefault("tool_timeout_s", self.limits.call_timeout_s + 10.0)
        super().__init__(max_turns=max_turns, **kwargs)
        if tools is not None:
            if isinstance(tools, str) or not tools:
                raise ValueError(f"tools: a non-empty list of tool names, got {tools!r}")
            for name in tools:
                if name not in self.tools:
                    import difflib

                    close = difflib.get_close_matches(str(name), list(self.tools), n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ValueError(f"tools: unknown tool {name!r}{hint}; expected some of {', '.join(self.tools)}")
            self.tools = {name: fn for name, fn in self.tools.items() if name in set(tools)}
        self.workspace: Workspace | None = None
        self.last_grading_note = ""

    # -- for subclasses -------------------------------------------------------------------------
    def new_repo(self, rng: random.Random, options: dict[str, Any]) -> tuple[bytes, list[Message]]:
        """The task: (the base tree as a tar archive, e.g. from ``make_tar``; the first messages)."""
        raise NotImplementedError

    def grade(self, tree: bytes) -> float:
        """The reward in [0, 1] of the final tree (a tar archive of ``/workspace``); see ``run_grader``."""
        raise NotImplementedError

    def run_grader(self, tree: bytes, harness: str, *, command: str = "python3 /.agentrl/hidden",
                   limits: WorkspaceLimits | None = None) -> CommandResult:
        """Run ``command`` in a fresh workspace made from ``tree``, with ``harness`` readable only there
        (at ``/.agentrl/hidden``, read-only) and the shell in ``/workspace``; returns what it printed.

        Its output is the graded program's: judge it against what only this process knows (expected
        values computed here), never against what the program says about itself.
        """
        grader_limits = limits or WorkspaceLimits(call_timeout_s=30.0, max_output_bytes=1 << 16,
                                                  max_disk_bytes=self.limits.max_disk_bytes)
        with Workspace(tree, grader_limits, hidden=harness.encode()) as fresh:
            return fresh.bash(command)

    # -- the episode ----------------------------------------------------------------------------
    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        self._close_workspace()
        base, messages = self.new_repo(rng, options)
        self.workspace = Workspace(base, self.limits)
        return messages

    def respond(self, action: str) -> Turn:
        turn = super().respond(action)
        if not turn.terminated and self.num_turns >= self.max_turns:  # truncated: graded all the same
            turn.reward = self._final_reward()
            turn.info["graded"] = True
        return turn

    async def astep(self, action: str) -> tuple[list, float, bool, bool, dict]:
        if not self._done and self.num_turns + 1 >= self.max_turns:
            import anyio

            return await anyio.to_thread.run_sync(self.step, action, abandon_on_cancel=False)
        return await super().astep(action)

    def score(self, answer: str) -> float:
        return self._final_reward()

    def _final_reward(self) -> float:
        self.last_grading_note = ""
        workspace = self._require_workspace()
        try:
            tree = workspace.snapshot()
        except Exception as exc:  # e.g. the agent's sandbox was killed from outside: nothing to grade
            self.last_grading_note = f"no final tree: {type(exc).__name__}: {exc}"
            return 0.0
        finally:
            self._close_workspace()
        return float(min(1.0, max(0.0, self.grade(tree))))

    def _require_workspace(self) -> Workspace:
        if self.workspace is None:
            raise RuntimeError("no workspace: call reset() first")
        return self.workspace

    def _close_workspace(self) -> None:
        if self.workspace is not None:
            self.workspace.close()
            self.workspace = None

    def close(self) -> None:
        self._close_workspace()
        super().close()

    # -- the tools ------------------------------------------------------------------------------
    @tool
    def bash(self, command: str) -> str:
        """Run a bash command in the repository's persistent shell (cd and exported variables carry over).

        Args:
            command: The command line, e.g. "python -m unittest discover -s tests".
        """
        return self._require_workspace().bash(command).describe()

    @tool
    def read_file(self, path: str) -> str:
        """Read a text file.

        Args:
            path: The file's path, relative to the shell's current directory or absolute.
        """
        return self._require_workspace().read_file(path)

    @tool
    def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a text file (parent directories are created).

        Args:
            path: The file's path.
            content: The whole new content of the file.
        """
        return self._require_workspace().write_file(path, content)

    @tool
    def str_replace(self, path: str, old: str, new: str) -> str:
        """Replace the one occurrence of a piece of text in a file.

        Args:
            path: The file's path.
            old: The exact text to replace; it must occur exactly once in the file.
            new: The text to put in its place.
        """
        return self._require_workspace().str_replace(path, old, new)

    @tool
    def list_dir(self, path: str = ".", depth: int = 2) -> str:
        """List the files and directories under a directory (directories end with "/").

        Args:
            path: The directory, relative to the shell's current directory or absolute.
            depth: How many levels down to list (1 to 8).
        """
        return self._require_workspace().list_dir(path, depth)
