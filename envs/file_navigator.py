"""FileNavigator-v0 (long context): answer questions about a synthetic file tree with ls and read.

Two task kinds, both needing many files read: sum the ``workers`` setting over every service's
``config.ini``, or find the one log file that mentions a request id. With the defaults (32 files of
40 lines each) reading every relevant file puts 55-70k characters of numbers and ids, ~16k tokens,
into the context; ``num_files`` and ``lines_per_file`` scale it linearly.
"""

from __future__ import annotations

import posixpath
import random
import re
from typing import Any

from agentrl.envs.base import Message, ToolEnv
from agentrl.envs.calculator import last_integer
from agentrl.envs.tools import tool

__all__ = ["FileNavigatorEnv"]

SYSTEM = ("Explore the file system with the ls and read tools. When you know the answer, reply without a "
          "tool call; that reply is your final answer.")
SERVICES = ("auth", "billing", "search", "media", "users", "orders", "cart", "email", "geo", "ledger", "notify",
            "pricing", "queue", "report", "session", "shipping", "stock", "tax", "upload", "vault")
SETTINGS = ("timeout_ms", "retry_limit", "cache_ttl_s", "pool_size", "batch_size", "backoff_ms", "max_body_kb",
            "idle_conns", "log_sample_pct", "queue_depth", "health_port", "shard_count")
LEVELS = ("INFO", "INFO", "INFO", "WARN", "DEBUG", "ERROR")
EVENTS = ("request done", "cache miss", "retry scheduled", "upstream slow", "token refreshed", "write committed")


class FileNavigatorEnv(ToolEnv):
    """Questions over a per-seed file tree; reward 1.0 for the right total or path.

    Args:
        num_files: service configs and log files (each).
        lines_per_file: lines per config or log file.
        task: "sum", "find", or None for a seeded choice.
        max_turns: steps before truncation.
        **kwargs: ``tool_timeout_s``, ``max_tool_calls_per_turn``, ``max_tool_output_chars``.
    """

    def __init__(self, *, num_files: int = 32, lines_per_file: int = 40, task: str | None = None,
                 max_turns: int = 48, max_tool_output_chars: int = 16_000, **kwargs: Any) -> None:
        super().__init__(max_turns=max_turns, max_tool_output_chars=max_tool_output_chars, **kwargs)
        if task not in (None, "sum", "find") or num_files < 1 or lines_per_file < 2:
            raise ValueError(f"need task in (None, 'sum', 'find'), num_files >= 1, lines_per_file >= 2; got "
                             f"{task!r}, {num_files}, {lines_per_file}")
        self.num_files, self.lines_per_file, self.task = num_files, lines_per_file, task
        self.files: dict[str, str] = {}
        self.gold: int | str = 0

    def new_task(self, rng: random.Random, options: dict[str, Any]) -> list[Message]:
        names = [f"{SERVICES[i % len(SERVICES)]}{i // len(SERVICES) or ''}" for i in range(self.num_files)]
        rng.shuffle(names)
        self.files, workers = {"/README.md": "Services live in /services, their logs in /logs.\n"}, {}
        for name in names:
            lines = [f"{rng.choice(SETTINGS)} = {rng.randint(1, 5000)}  # set {rng.randint(2019, 2024)} by "
                     f"team-{rng.choice(SERVICES)}" for _ in range(self.lines_per_file - 1)]
            workers[name] = rng.randint(1, 64)
            lines.insert(rng.randrange(len(lines) + 1), f"workers = {workers[name]}  # worker processes")
            self.files[f"/services/{name}/config.ini"] = "\n".join([f"[{name}]", *lines]) + "\n"
            self.files[f"/services/{name}/OWNERS"] = f"team-{rng.choice(SERVICES)}\n"
        ids = rng.sample(range(16**6), self.num_files * self.lines_per_file + 1)
        target, log_paths = f"req-{ids.pop():06x}", []
        for day, name in enumerate(names):
            path = f"/logs/{name}-2024-05-{day % 28 + 1:02d}.log"
            log_paths.append(path)
            self.files[path] = "".join(
                f"12:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d} {rng.choice(LEVELS)} {name} "
                f"req-{ids.pop():06x} {rng.choice(EVENTS)} {rng.randint(1, 999)}ms\n" for _ in range(self.lines_per_file))
        chosen = rng.choice(log_paths)
        lines = self.files[chosen].splitlines(keepends=True)
        i = rng.randrange(len(lines))
        lines[i] = re.sub(r"req-[0-9a-f]{6}", target, lines[i])
        self.files[chosen] = "".join(lines)
        task = self.task or rng.choice(("sum", "find"))
        if task == "sum":
            self.gold = sum(workers.values())
            question = ("Each service in /services has a config.ini with a workers setting. What is the total "
                        "number of workers over all services? End with: The answer is N.")
        else:
            self.gold = chosen
            question = f"Exactly one log file in /logs mentions {target}. Which file? Answer with its full path."
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

    @staticmethod
    def _norm(path: str) -> str:
        return posixpath.normpath("/" + path.strip().lstrip("/"))  # "//x" would stay "//x"

    @tool
    def ls(self, path: str) -> str:
        """List a directory: one entry per line, directories end with "/".

        Args:
            path: A directory path, e.g. "/services".
        """
        base = self._norm(path).rstrip("/") + "/"
        entries = sorted({p[len(base):].split("/")[0] + ("/" if "/" in p[len(base):] else "")
                          for p in self.files if p.startswith(base)})
        if not entries:
            raise FileNotFoundError(f"no such directory: {path[:100]!r}")
        return "\n".join(entries)

    @tool
    def read(self, path: str) -> str:
        """Read a whole text file.

        Args:
            path: A file path, e.g. "/README.md".
        """
        norm = self._norm(path)
        if norm not in self.files:
            is_dir = any(p.startswith(norm.rstrip("/") + "/") for p in self.files)
            raise (IsADirectoryError if is_dir else FileNotFoundError)(f"not a file: {path[:100]!r}")
        return self.files[norm]

    def score(self, answer: str) -> float:
        if isinstance(self.gold, int):
            return 1.0 if last_integer(answer) == self.gold else 0.0
        paths = re.findall(r"/logs/[\w.-]*\w", answer)
        return 1.0 if paths and paths[-1] == self.gold else 0.0
