"""Process checks the workspace tests share, made from outside the sandbox under test."""

from __future__ import annotations

import os


def ns_members(namespaces: set[str] | list[str]) -> list[int]:
    """Host PIDs of every process on the machine that is in one of these PID namespaces."""
    wanted = set(namespaces)
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.readlink(f"/proc/{entry.name}/ns/pid") in wanted:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
