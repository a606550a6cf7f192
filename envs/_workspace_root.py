"""The read-only root file system of a workspace sandbox: the Python sandbox's tree plus a shell and tools.

A coding agent needs more than ``python -I -S``: ``bash``, the coreutils, ``grep``, ``sed``, ``find``,
``diff``, ``patch``, ``tar``. This tree is the one ``_sandbox_root.py`` prepares (the interpreter, its
standard library and shared libraries, hard links to the host's files) with those programs added at
``/usr/bin`` (``/bin`` a link to it), ``python3``/``python`` as links to the interpreter, the workspace's
init script at ``/.agentrl/init.sh``, a minimal ``/etc`` (``passwd``/``group`` naming only ``nobody``) and
empty mount points ``/workspace`` and ``/tmp``. Still no host ``/etc``, ``/home``, project files or
``site-packages``. Built once under the same cache as the sandbox's tree, named by a hash of what it
holds. Knows nothing of bwrap's options (``_workspace_sandbox.py``) or of tools (``workspace.py``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import threading
from pathlib import Path

from agentrl.envs import _sandbox_root as base

__all__ = ["INIT_PATH", "PLACEHOLDERS", "PROGRAMS", "WorkspaceRoot", "workspace_root"]

INIT_PATH = "/.agentrl/init.sh"
PLACEHOLDERS = ("/.agentrl/base.tar", "/.agentrl/hidden")
PROGRAMS = (
    "bash", "sh", "ls", "cat", "head", "tail", "wc", "grep", "sed", "awk", "find", "xargs", "sort", "uniq", "cut",
    "tr", "diff", "cmp", "mkdir", "rm", "cp", "mv", "touch", "ln", "chmod", "env", "sleep", "tar", "basename",
    "dirname", "realpath", "readlink", "stat", "du", "df", "nl", "tee", "patch", "seq", "date", "od", "base64",
    "rmdir", "which", "ps", "timeout", "md5sum", "sha256sum", "comm", "paste", "expr", "yes", "id", "whoami",
    "uname", "true", "false", "printf", "echo", "test", "kill", "nproc", "fold", "rev", "split", "mktemp",
    "setsid", "nohup", "pgrep", "pkill", "gzip", "xxd", "less", "file",
)  # fmt: skip
_INIT_SOURCE = Path(__file__).with_name("_workspace_init.sh")
_FORMAT = 1
_LOCK = threading.Lock()


class WorkspaceRoot:
    """A prepared tree: ``path`` (bound read-only as ``/``) and the interpreter's path inside it."""

    def __init__(self, path: str, executable: str) -> None:
        self.path = path
        self.executable = executable


def _programs() -> dict[str, str]:
    """name -> real host path of each program of ``PROGRAMS`` found on this machine's PATH."""
    found = {}
    for name in PROGRAMS:
        path = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
        if path is not None:
            found[name] = os.path.realpath(path)
    missing = {"bash", "tar", "cat"} - found.keys()
    if missing:
        raise FileNotFoundError(f"the workspace sandbox needs {', '.join(sorted(missing))} on this machine "
                                "(Debian packages bash, tar, coreutils)")
    return found


def _build(root: Path, executable: str, stdlib: list[str], libraries: list[str], programs: dict[str, str]) -> None:
    base._build(root, executable, stdlib, libraries)  # the Python sandbox's tree; then what a shell needs
    os.unlink(root / "tmp")  # there a link to /sandbox; here a mount point of its own
    for point in ("tmp", "workspace", "etc", "usr/bin"):
        (root / point).mkdir(parents=True, exist_ok=True)
    if not (root / "bin").exists():
        os.symlink("usr/bin", root / "bin")
    for name, real in programs.items():
        dest = root / "usr/bin" / name
        if not os.path.lexists(dest):
            base._place(real, str(dest))
    for name in ("python3", "python"):
        if not os.path.lexists(root / "usr/bin" / name):
            os.symlink(executable, root / "usr/bin" / name)
    (root / "etc/passwd").write_text("nobody:x:65534:65534:nobody:/workspace:/bin/bash\n")
    (root / "etc/group").write_text("nogroup:x:65534:\n")
    shutil.copyfile(_INIT_SOURCE, root / INIT_PATH.lstrip("/"))
    for placeholder in PLACEHOLDERS:  # files that per-sandbox data is bound over
        (root / placeholder.lstrip("/")).touch(mode=0o644)
    for dirpath, _, _ in os.walk(root):
        os.chmod(dirpath, 0o755)
    for path in ("etc/passwd", "etc/group", INIT_PATH.lstrip("/"), *(p.lstrip("/") for p in PLACEHOLDERS)):
        os.chmod(root / path, 0o644)


@functools.lru_cache(maxsize=1)
def _workspace_root() -> WorkspaceRoot:
    executable, stdlib, libraries = base._contents()
    programs = _programs()
    libraries = sorted(set(libraries) | set(base._ldd_objects(sorted(set(programs.values())))))
    inside_stdlib = [lib for lib in libraries if any(os.path.realpath(lib).startswith(d + os.sep) for d in stdlib)]
    libraries = [lib for lib in libraries if lib not in inside_stdlib]
    digest = hashlib.sha256(f"workspace-{_FORMAT}\n".encode() + _INIT_SOURCE.read_bytes())
    for name, path in sorted(programs.items()):
        st = os.stat(path)
        digest.update(f"{name}\t{path}\t{st.st_ino}\t{st.st_mtime_ns}\t{st.st_size}\n".encode())
    child = base._CHILD_SOURCE.read_bytes()
    root = base._cache_dir() / f"ws-{base._tag(executable, stdlib, libraries, child)}-{digest.hexdigest()[:12]}"
    if not (root / INIT_PATH.lstrip("/")).exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(root.parent, 0o755)
        tmp = root.parent / f".{root.name}.tmp{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _build(tmp, executable, stdlib, libraries, programs)
            os.chmod(tmp, 0o755)
            os.rename(tmp, root)
        except OSError:
            if not (root / INIT_PATH.lstrip("/")).exists():  # not "another process made it first"
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return WorkspaceRoot(str(root), executable)


def workspace_root() -> WorkspaceRoot:
    """The prepared tree, built on first use (a few seconds) and kept.

    Raises:
        FileNotFoundError: ``ldd`` or ``bash``/``tar``/``cat`` is missing.
        OSError: the cache directory cannot be written.
    """
    with _LOCK:
        return _workspace_root()
