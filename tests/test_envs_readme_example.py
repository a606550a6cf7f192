"""The README's "Define your own tool-use environment" example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import gymnasium

HEADING = "Define your own tool-use environment"
SOURCES = [Path(__file__).resolve().parents[1] / "README.md", Path("/tmp/readme_fragments/envs.md")]


def readme_example() -> str:
    """The first ```python block after the heading, from README.md once the section is there."""
    for path in SOURCES:
        text = path.read_text(encoding="utf-8") if path.exists() else ""
        if HEADING in text:
            return re.search(r"```python\n(.*?)```", text.split(HEADING, 1)[1], re.DOTALL).group(1)
    raise AssertionError(f"no section {HEADING!r} in {[str(p) for p in SOURCES]}")


def test_readme_example_runs_and_is_short():
    code = readme_example()
    assert len(code.strip().splitlines()) <= 30
    namespace: dict = {}
    try:
        exec(compile(code, "README example", "exec"), namespace)
        env = namespace["env"]
        assert namespace["reward"] == 1.0 and namespace["info"]["num_tool_calls"] == 0
        assert [t["function"]["name"] for t in env.reset(seed=0)[1]["tools"]] == ["to_km"]
        assert env.step("That is 1 km.")[1] == 0.0
    finally:
        gymnasium.registry.pop("my/Units-v0", None)
