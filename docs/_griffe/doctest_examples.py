"""Griffe extension for the API reference: docstrings are read as the Python prose they are.

Two habits of agentrl's docstrings that MkDocs would otherwise misread, fixed before parsing:

- doctests under ``Example:`` (singular): Griffe's Google parser reads only ``Examples:`` as an
  examples section and renders ``Example:`` as an admonition of Markdown text, where ``>>> x[i]``
  becomes prose; the heading is renamed, so the doctests render as code;
- indexing in prose, ``[rank][micro-batch]``: Markdown reads it as a reference link (a broken
  cross-reference); outside code spans the second bracket is escaped;
- one ``Args:`` entry for several parameters (``rank, world_size: ...``): Griffe cannot match it
  to the signature, so that docstring's parameter warnings are turned off (only that one).

It knows nothing of agentrl; mkdocs.yml loads it (``extensions:`` of the python handler's options).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

__all__ = ["DoctestExamples"]

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.MULTILINE)
_GROUPED_PARAM = re.compile(r"^\s+[A-Za-z_]\w*(?:, [A-Za-z_]\w*)+:\s", re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")


def _escape_indexing(line: str) -> str:
    """``a[i][j]`` -> ``a[i]\\[j]`` outside code spans and doctest lines."""
    if line.lstrip().startswith((">>>", "...")) or "][" not in line:
        return line
    out, last = [], 0
    for span in _CODE_SPAN.finditer(line):
        out += [line[last:span.start()].replace("][", "]\\["), span.group(0)]
        last = span.end()
    return "".join(out) + line[last:].replace("][", "]\\[")


class DoctestExamples(griffe.Extension):
    """Rename ``Example:`` headings to ``Examples:`` and escape indexing in every docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None:
            return
        lines, in_fence = [], False
        for line in _HEADING.sub(r"\1Examples:", obj.docstring.value).split("\n"):
            if line.lstrip().startswith(("```", "~~~")):
                in_fence = not in_fence
            lines.append(line if in_fence else _escape_indexing(line))
        obj.docstring.value = "\n".join(lines)
        if _GROUPED_PARAM.search(obj.docstring.value):
            obj.docstring.parser_options = {
                **(obj.docstring.parser_options or {}), "warn_unknown_params": False, "warn_missing_types": False,
            }
