"""Entry point of a sandbox process (run as ``python -I -S _sandbox_child.py CONFIG``).

Applies resource limits, installs the audit hook unless the config turns it off (no process creation,
no sockets, no writes outside the working directory, no reads outside it and the Python installation, no
blocked imports), then runs ``main.py`` from the working directory. Under the bwrap backend the hook is
a second layer that gives clear messages; the boundary is the kernel's (see ``_bwrap.py``).
Only the standard library is used, and little of it (start-up time is most of a short run's cost: no
``json``, ``traceback`` only after an error); nothing here is imported by agentrl itself.
CONFIG is ``name=value`` pairs joined by ``;`` (see ``encode_config`` in ``sandbox.py``).
"""

import os
import sys

_SPAWN_EVENTS = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
    "socket.sendto", "gc.get_objects", "gc.get_referrers", "gc.get_referents", "ctypes.dlopen",
})
# event -> (positions of path arguments that must stay inside the working directory, of dir_fd arguments)
_PATH_EVENTS = {
    "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.link": ((0, 1), (2, 3)), "os.mkdir": ((0,), (2,)),
    "os.remove": ((0,), (1,)), "os.rename": ((0, 1), (2, 3)), "os.rmdir": ((0,), (1,)),
    "os.symlink": ((1,), (2,)), "os.truncate": ((0,), ()), "os.utime": ((0,), (3,)), "os.setxattr": ((0,), ()),
    "os.removexattr": ((0,), ()), "shutil.rmtree": ((0,), (1,)),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _parse_config(text: str) -> dict:
    config = {}
    for item in text.split(";"):
        name, _, value = item.partition("=")
        if name == "blocked_modules":
            config[name] = [m for m in value.split(",") if m]
        else:
            config[name] = int(value) if value else None
    return config


def _report(exc: BaseException) -> None:
    """A traceback of the user's frames only (not this file's)."""
    try:
        import traceback
    except BaseException:  # e.g. no memory left: the exception alone still says what happened
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        return
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]
    lines = traceback.format_list(frames) + traceback.format_exception_only(type(exc), exc)
    sys.stderr.write(("Traceback (most recent call last):\n" if frames else "") + "".join(lines))


def _apply_limits(config: dict) -> None:
    import resource

    mib = 1 << 20
    for name, value in (("RLIMIT_CPU", config["cpu_time_s"]), ("RLIMIT_AS", config["memory_mb"] * mib),
                        ("RLIMIT_FSIZE", config["max_file_bytes"]), ("RLIMIT_CORE", 0),
                        ("RLIMIT_NPROC", config["nproc"]), ("RLIMIT_NOFILE", config.get("max_open_files"))):
        if value is not None:
            resource.setrlimit(getattr(resource, name), (value, value))
    del sys.modules["resource"]  # a later `import resource` goes through the audit hook


def _install_hook(root: str, blocked_modules: frozenset) -> None:
    realpath, isabs, sep, fsdecode = os.path.realpath, os.path.isabs, os.sep, os.fsdecode
    spawn_events, path_events, write_flags = _SPAWN_EVENTS, dict(_PATH_EVENTS), _WRITE_FLAGS
    writable = (root, "/dev/null")
    readable = tuple({realpath(p) for p in (root, sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                            f"/proc/{os.getpid()}", "/dev/null", "/dev/zero", "/dev/urandom",
                                            __file__)})

    def inside(path: object, roots: tuple = writable) -> bool:
        if isinstance(path, int):  # an already-open descriptor
            return True
        resolved = realpath(fsdecode(path))
        return any(resolved == r or resolved.startswith(r + sep) for r in roots)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & write_flags)
            # os.open(..., dir_fd=) does not show its dir_fd here, so its write paths must be absolute
            relative_os_open = mode is None and not isinstance(path, int) and not isabs(fsdecode(path))
            if writing and (not inside(path) or relative_os_open):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path!r}")
            if not inside(path, readable):  # no credentials, other processes, or the env's own source
                raise PermissionError(f"sandbox: reading outside the working directory and the Python "
                                      f"standard library is not allowed: {path!r}")
        elif event == "import":
            name = args[0]
            if name in blocked_modules or name.partition(".")[0] in blocked_modules:
                raise ImportError(f"sandbox: importing '{name}' is not allowed")
        elif event in spawn_events:
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event in path_events:
            paths, dir_fds = path_events[event]
            if any(not inside(args[i]) for i in paths if i < len(args)) or any(
                    args[i] not in (-1, None) for i in dir_fds if i < len(args)):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

    sys.addaudithook(hook)


def main() -> None:
    config = _parse_config(sys.argv[1])
    _apply_limits(config)
    with open("main.py", encoding="utf-8") as f:
        source = f.read()
    if config.get("hook", 1):
        _install_hook(os.path.realpath(os.getcwd()), frozenset(config["blocked_modules"]))
    sys.stdout.reconfigure(line_buffering=True)  # what was printed survives a kill
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        _report(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
