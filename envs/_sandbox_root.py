"""The read-only root file system a bwrap sandbox sees: a minimal tree prepared once per interpreter.

The tree holds only what ``python -I -S`` and its standard library need: the interpreter, its standard
library (no ``site-packages``, tests or GUI demos), the shared libraries that ``ldd`` finds for the
interpreter and its extension modules (and the ELF loader), the sandbox's entry script compiled to
bytecode, empty mount points (``/proc``, ``/sandbox``, ``/tmp`` as a link to it) and a ``/dev`` of three
empty files over which bwrap binds the host's ``null``, ``zero`` and ``urandom``. Files are
hard links to the host's (copies where a link is not allowed), owned by the caller, in directories that
the sandbox uid can traverse, so the sandbox needs one read-only bind of the tree as ``/`` instead of one
bind per directory plus a bind of the entry script per run (each bind is a mount and a parse of the
mount table inside bwrap; see bench/history/sandbox.md).

Built under ``/var/cache/agentrl-sandbox`` (root) or ``$XDG_CACHE_HOME/agentrl-sandbox`` (other users),
named by a hash of everything it holds (interpreter, libraries, entry script), so a new interpreter or
entry script gets a new tree and a finished tree is never changed; concurrent builders race to a rename.
This module knows nothing of bwrap's options (``_bwrap.py``) or of running programs (``sandbox.py``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import py_compile
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

__all__ = ["CHILD_PATH", "DEVICES", "MOUNT_POINTS", "SandboxRoot", "sandbox_root"]

CHILD_PATH = "/.agentrl/child.pyc"  # the entry script, as bytecode: no compile per run
MOUNT_POINTS = ("/proc", "/sandbox")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")  # empty files here; the host's devices are bound over them
_LINKS = (("/tmp", "/sandbox"), ("/dev/fd", "/proc/self/fd"), ("/dev/stdin", "/proc/self/fd/0"),
          ("/dev/stdout", "/proc/self/fd/1"), ("/dev/stderr", "/proc/self/fd/2"))
_CHILD_SOURCE = Path(__file__).with_name("_sandbox_child.py")
_SKIPPED = ("site-packages", "dist-packages", "test", "idlelib", "turtledemo")
_FORMAT = 2  # bump when the tree's layout changes
_LOCK = threading.Lock()


class SandboxRoot:
    """A prepared tree: ``path`` (bound read-only as ``/``) and the interpreter's path inside it."""

    def __init__(self, path: str, executable: str) -> None:
        self.path = path
        self.executable = executable


def _ldd_objects(objects: list[str]) -> list[str]:
    """The paths (as the loader looks them up) of the shared libraries and ELF loaders of ``objects``."""
    if shutil.which("ldd") is None:
        raise FileNotFoundError("the sandbox needs `ldd` (Debian package libc-bin) to find the interpreter's "
                                "shared libraries")
    # The sandbox runs its interpreter with a cleared environment (bwrap --clearenv), so its loader sees
    # no LD_PRELOAD or LD_LIBRARY_PATH: look the libraries up the same way. (vLLM's CPU platform sets
    # LD_PRELOAD in the process that imports it; ldd would list those libraries too, from wherever the
    # venv lies, e.g. under /tmp, where the sandbox mounts its own /tmp.)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    out = subprocess.run(["ldd", *objects], capture_output=True, text=True, timeout=120, check=False,
                         env=env).stdout
    found = set()
    for line in out.splitlines():
        if not line[:1].isspace():  # "path/of/object:" headers, not libraries
            continue
        parts = line.split("=>")
        target = (parts[1] if len(parts) > 1 else parts[0]).strip().split(" (")[0].strip()
        if target.startswith("/"):
            found.add(target)
    return sorted(found)


def _libgcc_s(libraries: list[str]) -> list[str]:
    """``libgcc_s.so.1`` beside libc: glibc loads it at run time to unwind a cancelled or exiting thread."""
    for lib in libraries:
        if os.path.basename(lib).startswith("libc.so"):
            candidate = os.path.join(os.path.dirname(lib), "libgcc_s.so.1")
            if os.path.exists(candidate):
                return [candidate]
    return []


def _stdlib_dirs() -> list[str]:
    """The base installation's standard library directories (in a virtualenv, not the venv's)."""
    paths = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix,
                                      "installed_base": sys.base_prefix, "installed_platbase": sys.base_exec_prefix})
    dynload = os.path.join(paths["platstdlib"], "lib-dynload")
    dirs = {os.path.realpath(p) for p in (paths["stdlib"], paths["platstdlib"], dynload) if os.path.isdir(p)}
    return sorted(d for d in dirs if not any(d.startswith(o + os.sep) for o in dirs if o != d))  # outermost


def _contents() -> tuple[str, list[str], list[str]]:
    """(interpreter, standard-library directories, shared libraries as looked up) of this interpreter."""
    executable = os.path.realpath(sys.executable)
    stdlib = _stdlib_dirs()
    extensions = [str(p) for d in stdlib for p in Path(d).rglob("*.so") if not set(p.parts) & set(_SKIPPED)]
    libraries = _ldd_objects([executable, *extensions])
    libraries += _libgcc_s(libraries)
    inside_stdlib = [lib for lib in libraries if any(os.path.realpath(lib).startswith(d + os.sep) for d in stdlib)]
    return executable, stdlib, [lib for lib in libraries if lib not in inside_stdlib]


def _tag(executable: str, stdlib: list[str], libraries: list[str], child: bytes) -> str:
    digest = hashlib.sha256(f"{_FORMAT}\n{sys.version}\n".encode() + child)
    for path in (executable, *stdlib, *libraries):
        st = os.stat(path)
        digest.update(f"{path}\t{st.st_dev}\t{st.st_ino}\t{st.st_mtime_ns}\t{st.st_size}\n".encode())
    return f"{sys.implementation.cache_tag}-{digest.hexdigest()[:16]}"


def _cache_dir() -> Path:
    if os.getuid() == 0:
        return Path("/var/cache/agentrl-sandbox")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl-sandbox"


def _place(src: str, dst: str) -> None:
    """A hard link of ``src`` at ``dst`` (same inode, no copy), or a copy where linking is not allowed."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _mirror_link_ancestors(tree: Path, path: str) -> None:
    """Recreate in ``tree`` the host's directory symlinks on the way to ``path`` (e.g. ``/lib -> usr/lib``)."""
    current = "/"
    for part in Path(path).parts[1:-1]:
        current = os.path.join(current, part)
        if os.path.islink(current):
            link = tree / current.lstrip("/")
            if not os.path.lexists(link):
                link.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.readlink(current), link)
            current = os.path.realpath(current)


def _build(root: Path, executable: str, stdlib: list[str], libraries: list[str]) -> None:
    """Fill the empty directory ``root`` with the tree (see the module docstring)."""
    for directory in stdlib:
        shutil.copytree(directory, root / directory.lstrip("/"), symlinks=True, copy_function=_place,
                        ignore=shutil.ignore_patterns(*_SKIPPED))
    files = [executable, *libraries]
    for path in files:
        _mirror_link_ancestors(root, path)
    for path in files:  # the real file at the path the loader asks for, whatever the links on the host
        dest = root / os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path)).lstrip("/")
        if not os.path.lexists(dest):
            dest.parent.mkdir(parents=True, exist_ok=True)
            _place(os.path.realpath(path), str(dest))
    for point in MOUNT_POINTS:
        (root / point.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (root / "dev").mkdir()
    for device in DEVICES:
        (root / device.lstrip("/")).touch(mode=0o644)
    for link, target in _LINKS:
        os.symlink(target, root / link.lstrip("/"))
    child = root / CHILD_PATH.lstrip("/")
    child.parent.mkdir(parents=True, exist_ok=True)
    py_compile.compile(str(_CHILD_SOURCE), cfile=str(child), dfile=CHILD_PATH, doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    for dirpath, _, _ in os.walk(root):  # new directories only: a file keeps its original's mode (a hard link)
        os.chmod(dirpath, 0o755)
    os.chmod(child, 0o644)


@functools.lru_cache(maxsize=1)
def _sandbox_root() -> SandboxRoot:
    executable, stdlib, libraries = _contents()
    cache = _cache_dir()
    root = cache / _tag(executable, stdlib, libraries, _CHILD_SOURCE.read_bytes())
    if not (root / CHILD_PATH.lstrip("/")).exists():
        cache.mkdir(parents=True, exist_ok=True)
        os.chmod(cache, 0o755)
        tmp = cache / f".{root.name}.tmp{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _build(tmp, executable, stdlib, libraries)
            os.chmod(tmp, 0o755)
            os.rename(tmp, root)
        except OSError:
            if not (root / CHILD_PATH.lstrip("/")).exists():  # not "another process made it first"
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return SandboxRoot(str(root), executable)


def sandbox_root() -> SandboxRoot:
    """The prepared tree for this interpreter and entry script, built on first use (a few seconds) and kept.

    Raises:
        FileNotFoundError: ``ldd`` is missing.
        OSError: the cache directory cannot be written.
    """
    with _LOCK:
        return _sandbox_root()
