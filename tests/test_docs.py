"""Docs that cannot rot: the site builds strictly, every code block runs or says why not.

The rule for code blocks in README.md and docs/ (CONTRIBUTING.md explains it):

- a ```python block with no mark runs here, in order, in one namespace per page; the ``test_*``
  functions it defines are then called;
- ``<!-- doc-test: tests/test_x.py -->`` on the line above: that test file runs it (it must exist
  and name the page);
- ``<!-- not-runnable: reason -->`` on the line above: it is not run, and the reason says why;
- a ```yaml block with no mark is a piece of an agentrl config and must validate as one;
- an ``agentrl train`` or ``agentrl sft`` command of a shell block, on a config file of this
  repository, must parse (``--print-config``, which starts nothing).
"""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

import gymnasium
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.config import Config
from agentrl.docs import REPO, code_blocks, generated_files

PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").rglob("*.md")])
PYTHON = ("python", "py", "python3")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _runnable_pages() -> list[Path]:
    return [p for p in PAGES if any(b.language in PYTHON and b.mark is None for b in code_blocks(p))]


def test_readme_is_short():
    size = len((REPO / "README.md").read_text(encoding="utf-8"))
    assert size <= 12_000, f"README.md has {size} characters; move detail into docs/ (at most 12,000)"


def test_every_python_block_is_run_or_says_why_not():
    problems = []
    for page in PAGES:
        for block in code_blocks(page):
            if block.mark == "not-runnable" and len(block.mark_value.split()) < 3:
                problems.append(f"{block.where}: not-runnable needs a reason of a few words")
            if block.mark == "doc-test":
                test = REPO / block.mark_value
                if not test.is_file():
                    problems.append(f"{block.where}: doc-test names {block.mark_value}, which does not exist")
                elif _rel(page) not in test.read_text(encoding="utf-8"):
                    problems.append(f"{block.where}: {block.mark_value} does not read {_rel(page)}")
            if block.language in ("", "text", "pycon") and block.code.lstrip().startswith(("import ", "from ", ">>>")):
                problems.append(f"{block.where}: Python code in a ```{block.language} block: mark it ```python")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", _runnable_pages(), ids=_rel)
def test_python_blocks_run(page: Path, tmp_path, monkeypatch):
    """Unmarked blocks run in order in one namespace, from a scratch directory; envs they register
    are removed afterwards."""
    import agentrl.envs  # noqa: F401  registers the built-in envs now: a block's first import would
    # register them inside the block, the cleanup below would remove them, and a later import (cached) would not
    # register them again, so later tests in the process would find no agentrl/ envs

    monkeypatch.chdir(tmp_path)
    registered = set(gymnasium.registry)
    namespace: dict = {"__name__": f"docs:{_rel(page)}"}
    try:
        for block in code_blocks(page):
            if block.language in PYTHON and block.mark is None:
                exec(compile(block.code, block.where, "exec"), namespace)
        for name, fn in list(namespace.items()):
            if name.startswith("test_") and callable(fn):
                fn()
    finally:
        for env_id in set(gymnasium.registry) - registered:
            gymnasium.registry.pop(env_id)


def test_yaml_blocks_are_valid_config():
    problems = []
    for page in PAGES:
        for block in code_blocks(page):
            if block.language in ("yaml", "yml") and block.mark is None:
                try:
                    Config.model_validate(yaml.safe_load(block.code) or {})
                except Exception as err:  # noqa: BLE001 - reported with the block's place
                    problems.append(f"{block.where}: {type(err).__name__}: {err}")
    assert not problems, "\n".join(problems)


def _agentrl_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every `agentrl train|sft CONFIG ...` in a shell block, CONFIG a repo file."""
    found = []
    for page in PAGES:
        for block in code_blocks(page):
            if block.language not in ("bash", "sh", "shell", "console") or block.mark is not None:
                continue
            for command in block.code.replace("\\\n", " ").split("\n"):
                words = shlex.split(command.split(" #")[0])
                if words[:1] == ["agentrl"] and words[1:2] in (["train"], ["sft"]) and (REPO / words[2]).is_file():
                    found.append((block.where, words[1:]))
    return found


def test_agentrl_commands_in_docs_parse():
    from agentrl.cli import main

    commands = _agentrl_commands()
    assert len(commands) >= 3  # the quickstart, GPU and long-context commands at least
    problems = []
    for where, argv in commands:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([*argv, "--print-config"])  # returns 2 on a config error
            except SystemExit as exit_:  # --print-config exits 0 after printing
                code = exit_.code
        if code not in (0, None):
            problems.append(f"{where}: agentrl {shlex.join(argv)}: {err.getvalue().strip()}")
    assert not problems, "\n".join(problems)


def test_generated_docs_are_current():
    stale = [rel for rel, text in generated_files().items()
             if not (REPO / rel).is_file() or (REPO / rel).read_text(encoding="utf-8") != text]
    assert not stale, f"stale generated docs: {stale}; run python -m agentrl.docs"


def test_readme_links_resolve():
    """README.md lies outside the site, so mkdocs does not check its links: this does."""
    import re

    text = (REPO / "README.md").read_text(encoding="utf-8")
    missing = [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
               if "://" not in t and not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_mkdocs_build_strict(tmp_path):
    """A broken link, a page missing from the nav or an API object that cannot be found fails it."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "api" / "agentrl.learner.losses" / "index.html").is_file()


_LINE = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=30).filter(lambda s: "`" not in s and "~~~" not in s)


@settings(max_examples=60, deadline=None)
@given(blocks=st.lists(st.tuples(st.sampled_from(["python", "yaml", "bash", ""]),
                                 st.lists(_LINE, max_size=5),
                                 st.sampled_from([None, "doc-test", "not-runnable"]),
                                 st.sampled_from(["tests/test_x.py", "needs a GPU to run"])), max_size=4),
       prose=st.lists(_LINE, max_size=3))
def test_code_blocks_round_trip(tmp_path_factory, blocks, prose):
    """A page written from blocks (with marks and prose between) parses back into those blocks."""
    lines = []
    for language, code, mark, value in blocks:
        lines += [p for p in prose if not p.lstrip().startswith("<!--")] + [""]
        if mark:
            lines.append(f"<!-- {mark}: {value} -->")
        lines += [f"```{language}", *code, "```"]
    page = tmp_path_factory.mktemp("page") / "p.md"
    page.write_text("\n".join(lines) + "\n", encoding="utf-8")
    parsed = code_blocks(page)
    assert [(b.language, b.code, b.mark, b.mark_value if b.mark else None) for b in parsed] == [
        (lang, "".join(c + "\n" for c in code), mark, value if mark else None) for lang, code, mark, value in blocks]
