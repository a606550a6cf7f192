"""An agent worker process: runs the user's agent functions for a rollout worker (``agent.workers``).

Started by :class:`agentrl.rollout.agent.pool.AgentWorkerPool` as ``python -m agentrl.rollout.agent.worker PARENT_PID``
(a plain subprocess: inside a Ray actor ``__main__`` is Ray's worker script, which a multiprocessing
spawn would import again). It speaks length-prefixed pickle frames on the stdin and stdout it was given, through private
copies of their descriptors: fd 1 and ``sys.stdout`` go to stderr and fd 0 reads /dev/null, so
neither the agent's ``print`` nor a subprocess it starts can corrupt or steal a frame.

Parent to worker: ``("init", {"sys_path": [...]})`` once, then ``("job", id, spec)`` with spec
``{"solve", "score", "task", "base_url", "api_key", "request_timeout_s"}`` and ``("cancel", id)``.
Worker to parent: ``("done", id, reward)`` or ``("error", id, type_name, text)``. Jobs run
concurrently: async agents on this process's event loop, sync agents in threads, as in the
rollout worker's own process (:func:`agentrl.rollout.agent.user.solve_and_score`), on uvloop where it is
installed (``AGENTRL_AGENT_WORKER_LOOP=asyncio`` in the environment: asyncio's own loop, for
comparison: ``bench/agent_endpoint.py --agent-workers 2,2:asyncio``). The worker exits when stdin
reaches EOF (the parent closed it, or died) and, on Linux, when its parent dies.

This module knows nothing of Ray, the endpoint or the engine: an agent reaches the endpoint over
HTTP with the base URL and key of its episode.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from typing import Any

from agentrl.rollout.agent.protocol import encode_frame, read_frame

__all__ = ["encode_frame", "read_frame"]

def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies, even if the event loop is blocked (an
    async agent that calls time.sleep) and would not see stdin's EOF."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(0)


class _Worker:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.jobs: dict[int, asyncio.Task] = {}
        self.functions: dict[str, Any] = {}
        self.http_clients: dict[Any, Any] = {}

    def send(self, message: Any) -> None:
        self.writer.write(encode_frame(message))  # one write per frame: frames never interleave

    def function(self, spec: str) -> Any:
        """``module:function``, imported here as the parent did (it checked the name already;
        agentrl's built-in envs are not imported: torch and transformers would cost each worker
        seconds and hundreds of MB, unless the user's module imports them itself)."""
        fn = self.functions.get(spec)
        if fn is None:
            import importlib

            module, _, name = spec.partition(":")
            fn = self.functions[spec] = getattr(importlib.import_module(module), name)
        return fn

    async def run(self, job_id: int, spec: dict[str, Any]) -> None:
        from agentrl.rollout.agent.user import shared_http_client, solve_and_score

        try:
            solve = self.function(spec["solve"])
            score = self.function(spec["score"]) if spec["score"] else None
            reward = await solve_and_score(solve, score, spec["task"], base_url=spec["base_url"],
                                           api_key=spec["api_key"], request_timeout_s=spec["request_timeout_s"],
                                           http_client=lambda: shared_http_client(self.http_clients))
        except asyncio.CancelledError:
            return  # the parent asked: it expects no answer
        except Exception as exc:  # the user's agent may raise anything: the parent fails the episode with it
            self.send(("error", job_id, type(exc).__name__, str(exc)))
        else:
            self.send(("done", job_id, reward))
        finally:
            self.jobs.pop(job_id, None)
        with contextlib.suppress(ConnectionError):  # the parent is gone: stdin's EOF ends this process
            await self.writer.drain()

    async def serve(self, reader: asyncio.StreamReader) -> None:
        while (message := await read_frame(reader)) is not None:
            kind = message[0]
            if kind == "job":
                _, job_id, spec = message
                self.jobs[job_id] = asyncio.get_running_loop().create_task(self.run(job_id, spec))
            elif kind == "cancel":
                task = self.jobs.pop(message[1], None)
                if task is not None:
                    task.cancel()
            elif kind == "init":
                parent_path = list(message[1]["sys_path"])
                sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
            else:
                raise ValueError(f"agent worker: unknown message {kind!r}")


async def _main(protocol_in: int, protocol_out: int) -> None:
    import anyio.to_thread

    # sync agents each hold a thread for their whole episode (as in the rollout worker's process)
    anyio.to_thread.current_default_thread_limiter().total_tokens = 1024
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(protocol_in, "rb", 0))
    transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin,
                                                        os.fdopen(protocol_out, "wb", 0))
    worker = _Worker(asyncio.StreamWriter(transport, protocol, None, loop))
    await worker.serve(reader)


def main() -> None:
    parent_pid = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    _die_with_parent(parent_pid)
    # The protocol keeps private copies of the pipes; fd 0 becomes /dev/null and fd 1 stderr, so
    # neither the agent's prints nor a subprocess it starts (which inherits fds 0-2) touch a frame.
    protocol_in, protocol_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    loop = None
    if os.environ.get("AGENTRL_AGENT_WORKER_LOOP", "uvloop") == "uvloop":
        with contextlib.suppress(ImportError):  # uvloop (uvicorn's, where installed): less CPU per request
            import uvloop

            loop = uvloop.new_event_loop()
    loop = loop or asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    status = 0
    try:
        loop.run_until_complete(_main(protocol_in, protocol_out))
    except KeyboardInterrupt:
        pass
    except BaseException:  # a corrupt stream: say why, and let the parent count a dead worker
        import traceback

        traceback.print_exc()
        status = 2
    # EOF on stdin: the parent is done with this worker. Leave at once, with no loop or interpreter
    # shutdown: a sync agent's thread may be stuck in the user's code, and either would wait for it.
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
