"""Rewrite references to agentrl's flat module layout (``agentrl.losses``, ``agentrl/refit.py``, ...)
to the role packages (``agentrl.learner.losses``, ``agentrl/weights/transports.py``, ...).

For code written against the old layout: imports, ``mock.patch`` targets, dotted-path strings,
docstring cross-references and file paths in any text file.

    python scripts/rewrite_old_imports.py FILE...             # rewrite these files in place
    python scripts/rewrite_old_imports.py --since REV         # only the lines changed since REV, in
                                                              # every file git shows as changed
    python scripts/rewrite_old_imports.py --check FILE...     # list what would change, exit 1 if any

``agentrl.rollout`` and ``agentrl.replay`` were modules and are packages now, so a bare
``agentrl.rollout`` is read as the old module (``agentrl.rollout.episode``): run this on old code,
or with ``--since``, not on code already written for the packages.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

# old dotted module -> new dotted module
MODULES = {
    "agentrl.config_base": "agentrl.config.base",
    "agentrl.config_learner": "agentrl.config.learner",
    "agentrl.config_rollout": "agentrl.config.rollout",
    "agentrl.config_training": "agentrl.config.training",
    "agentrl.env_ids": "agentrl.env.ids",
    "agentrl.rollout": "agentrl.rollout.episode",
    "agentrl.chat": "agentrl.rollout.chat",
    "agentrl.tool_calls": "agentrl.rollout.tool_calls",
    "agentrl.trajectory": "agentrl.rollout.trajectory",
    "agentrl.endpoint": "agentrl.rollout.agent.endpoint",
    "agentrl.recorder": "agentrl.rollout.agent.recorder",
    "agentrl.agents": "agentrl.rollout.agent.user",
    "agentrl.agent_pool": "agentrl.rollout.agent.pool",
    "agentrl.agent_protocol": "agentrl.rollout.agent.protocol",
    "agentrl.agent_worker": "agentrl.rollout.agent.worker",
    "agentrl.engines.vllm_engine": "agentrl.engine.vllm_engine",
    "agentrl.engines.worker_ext": "agentrl.weights.vllm_worker",
    "agentrl.engines": "agentrl.engine",
    "agentrl.refit": "agentrl.weights.transports",
    "agentrl.weight_sync": "agentrl.weights.sync",
    "agentrl.replay": "agentrl.replay.queue",
    "agentrl.learners": "agentrl.learner",
    **{f"agentrl.{m}": f"agentrl.learner.{m}"
       for m in ("losses", "advantages", "distill", "packing", "packed", "optim", "lora")},
    **{f"agentrl.{m}": f"agentrl.driver.{m}"
       for m in ("trainer", "supervision", "watchdog", "pipeline", "evaluate", "sft", "progress", "metrics")},
    "agentrl.models": "agentrl.model.loading",
    "agentrl.tiny": "agentrl.model.tiny",
    "agentrl.tiny_templates": "agentrl.model.tiny_templates",
}
# old file path -> new file path
PATHS = {old.replace(".", "/") + ".py": new.replace(".", "/") + ".py" for old, new in MODULES.items()}
PATHS.update({"agentrl/config.py": "agentrl/config/loading.py", "agentrl/engines/__init__.py": "agentrl/engine/__init__.py",
              "agentrl/learners/": "agentrl/learner/", "agentrl/engines/": "agentrl/engine/"})
# Strings that look like an old module but are not one: the learners' profiler ranges.
KEEP = {'"agentrl.metrics"'}


def _alternation(keys) -> str:
    return "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))  # longest first


# New submodules of what were modules (agentrl.rollout.chat) are not old names.
_NEW_SUBMODULE = r"(?!\.(?:episode|chat|tool_calls|trajectory|agent|queue)\b)"
DOTTED = re.compile(r"(?<![\w.])(" + _alternation(MODULES) + r")\b" + _NEW_SUBMODULE)
FILES = re.compile(r"(?<![\w.])(" + _alternation(PATHS) + r")(?!\w)")
FOLDERS = re.compile(r"(?<![\w./])agentrl/(learners|engines)\b")


def rewrite(text: str) -> str:
    """``text`` with every old module name and file path replaced, in one pass per form.

    Example:
        >>> rewrite("from agentrl.losses import compute_policy_loss  # see agentrl/refit.py")
        'from agentrl.learner.losses import compute_policy_loss  # see agentrl/weights/transports.py'
        >>> rewrite('mock.patch("agentrl.rollout.run_episode"); import agentrl.learners.megatron.model')
        'mock.patch("agentrl.rollout.episode.run_episode"); import agentrl.learner.megatron.model'
        >>> rewrite("from agentrl.rollout.chat import ChatRenderer") == "from agentrl.rollout.chat import ChatRenderer"
        True
    """

    def dotted(m: re.Match) -> str:
        s, e = m.span()
        return m.group(0) if text[max(0, s - 1):e + 1] in KEEP else MODULES[m.group(1)]

    text = DOTTED.sub(dotted, text)
    text = FILES.sub(lambda m: PATHS[m.group(1)], text)
    return FOLDERS.sub(lambda m: "agentrl/" + m.group(1)[:-1], text)


def changed_lines(since: str) -> dict[str, set[int]]:
    """File -> 1-based numbers of its lines added or changed since ``since`` (working tree)."""
    diff = subprocess.run(["git", "diff", "-U0", "--no-color", "--no-renames", since, "--"],
                          capture_output=True, text=True, check=True).stdout
    lines: dict[str, set[int]] = {}
    current = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            current = line[6:] if line.startswith("+++ b/") else None
        elif line.startswith("@@") and current:
            start, _, count = re.match(r"@@ -\S+ \+(\d+)(,(\d+))? @@", line).groups()
            n = 1 if count is None else int(count)
            lines.setdefault(current, set()).update(range(int(start), int(start) + n))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--since", help="rewrite only the lines changed since this git revision")
    parser.add_argument("--check", action="store_true", help="list what would change; exit 1 if any")
    args = parser.parse_args(argv)
    if bool(args.files) == bool(args.since):
        parser.error("give FILE... or --since REV")
    targets = changed_lines(args.since) if args.since else {f: None for f in args.files}
    changed = []
    for name, only in sorted(targets.items()):
        path = Path(name)
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
            continue
        lines = text.splitlines(keepends=True)
        new = "".join(rewrite(line) if only is None or i in only else line for i, line in enumerate(lines, 1))
        if new != text:
            changed.append(name)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    print("\n".join(changed))
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
