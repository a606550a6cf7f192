"""Agent worker processes of one rollout worker (``agent.workers`` > 0), the parent's side.

The user's agent functions, and the openai SDK's CPU with them (~2.5-4.5 ms per request), run in
``agent.workers`` processes of :mod:`agentrl.rollout.agent.worker` rather than in the rollout worker's own
process and event loop, which then only serves the endpoint's HTTP and talks to the engines. An
episode goes to the least-loaded worker; a worker process starts on its first episode. The
endpoint, and with it the exact-token record of every request, stays in the rollout worker.

A worker that dies (the agent calls ``os._exit``, segfaults, is killed) fails its in-flight
episodes with :class:`AgentWorkerDied`, naming its exit status, and is started again for the next
episode; ``rollout/agent_worker_deaths`` counts such deaths. :meth:`AgentWorkerPool.close` stops
every worker; a worker whose parent dies exits by itself (EOF on its stdin, and on Linux a
parent-death signal).

This module knows nothing of Ray: a rollout actor owns one pool through its :class:`~agentrl.rollout.agent.user.Agent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
from pathlib import Path
from typing import Any

from agentrl.rollout.agent.protocol import encode_frame, read_frame

__all__ = ["AgentRaised", "AgentWorkerDied", "AgentWorkerPool"]


class AgentRaised(Exception):
    """The agent (or its scorer) raised in a worker process: its exception's type name and text."""

    def __init__(self, type_name: str, text: str) -> None:
        super().__init__(f"{type_name}: {text}")
        self.type_name, self.text = type_name, text


class AgentWorkerDied(Exception):
    """The worker process running this episode's agent exited under it."""


def exit_status(returncode: int) -> str:
    """``exited with status 3`` / ``was killed by signal 9 (SIGKILL)``, from a Popen returncode."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "unknown signal"
    return f"was killed by signal {-returncode} ({name})"


class _Process:
    """One started worker process: its jobs in flight and the task that reads its answers."""

    def __init__(self, proc: asyncio.subprocess.Process, slot: int) -> None:
        self.proc = proc
        self.slot = slot
        self.pending: dict[int, asyncio.Future] = {}
        self.alive = True
        self.reader: asyncio.Task | None = None

    def send(self, message: Any) -> None:
        if self.alive and self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write(encode_frame(message))


class AgentWorkerPool:
    """``num_workers`` agent worker processes, each started on first use and again after it dies.

    Args:
        num_workers: processes (``agent.workers``).
        close_grace_s: at :meth:`close`, how long a worker may take to exit after its stdin
            closes before it is killed.
    """

    def __init__(self, num_workers: int, *, close_grace_s: float = 5.0) -> None:
        if num_workers < 1:
            raise ValueError(f"an agent worker pool needs at least 1 worker, got {num_workers}")
        self.num_workers = num_workers
        self.close_grace_s = close_grace_s
        self.load = [0] * num_workers  # episodes in flight per slot
        self.procs: list[_Process | None] = [None] * num_workers
        self.num_started = 0
        self.num_died = 0  # worker processes that exited while the pool was open
        self._locks: list[asyncio.Lock] | None = None
        self._ids = itertools.count()
        self._closed = False

    # -- workers ----------------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """The pids of the worker processes running now."""
        return [p.proc.pid for p in self.procs if p is not None and p.alive]

    async def _ensure(self, slot: int) -> _Process:
        if self._locks is None:
            self._locks = [asyncio.Lock() for _ in range(self.num_workers)]
        async with self._locks[slot]:
            if self._closed:
                raise RuntimeError("the agent worker pool is closed")
            current = self.procs[slot]
            if current is not None and current.alive:
                return current
            import agentrl

            # The worker imports agentrl as this process does; the user's modules come through
            # the init frame's sys.path (a Ray runtime_env's working dir or py_modules included).
            root = str(Path(agentrl.__file__).resolve().parents[1])
            env = dict(os.environ)
            if Path(root).name not in ("site-packages", "dist-packages"):  # a checkout: -m must find it
                env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agentrl.rollout.agent.worker", str(os.getpid()),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env)
            current = _Process(proc, slot)
            current.send(("init", {"sys_path": list(sys.path)}))
            current.reader = asyncio.get_running_loop().create_task(self._read(current))
            self.procs[slot] = current
            self.num_started += 1
            return current

    async def _read(self, p: _Process) -> None:
        assert p.proc.stdout is not None
        try:
            while (message := await read_frame(p.proc.stdout)) is not None:
                kind, job_id = message[0], message[1]
                fut = p.pending.pop(job_id, None)
                if fut is None or fut.done():  # cancelled here meanwhile
                    continue
                if kind == "done":
                    fut.set_result(message[2])
                else:
                    fut.set_exception(AgentRaised(message[2], message[3]))
        except Exception:  # a corrupt stream: the worker is of no more use
            with contextlib.suppress(ProcessLookupError):
                p.proc.kill()
        p.alive = False
        try:
            code = await asyncio.wait_for(p.proc.wait(), 10.0)
        except asyncio.TimeoutError:  # it closed the protocol's pipe but lives on
            with contextlib.suppress(ProcessLookupError):
                p.proc.kill()
            code = await p.proc.wait()
        if not self._closed:
            self.num_died += 1
        err = AgentWorkerDied(f"the agent's worker process (pid {p.proc.pid}, agent.workers slot {p.slot}) "
                              f"{exit_status(code)} while this episode's agent ran in it (its stderr, in this "
                              "process's log, may say why); later episodes get a new worker process")
        for fut in p.pending.values():
            if not fut.done():
                fut.set_exception(err)
        p.pending.clear()

    # -- jobs -------------------------------------------------------------------------------------
    async def run(self, solve: str, score: str | None, task: Any, *, base_url: str, api_key: str,
                  request_timeout_s: float) -> float:
        """Run ``solve`` (then ``score``), named as ``module:function``, on ``task`` in the
        least-loaded worker; its reward. Cancelling this cancels the agent in the worker.

        Raises:
            AgentRaised: the agent or scorer raised (or returned no finite number).
            AgentWorkerDied: the worker process exited before it answered.
        """
        slot = min(range(self.num_workers), key=lambda k: self.load[k])
        self.load[slot] += 1
        try:
            p = await self._ensure(slot)
            job_id = next(self._ids)
            spec = {"solve": solve, "score": score, "task": task, "base_url": base_url, "api_key": api_key,
                    "request_timeout_s": request_timeout_s}
            try:
                frame = encode_frame(("job", job_id, spec))
            except Exception as exc:
                raise TypeError(f"agent.workers: the task cannot be sent to an agent worker process "
                                f"(it must pickle): {type(exc).__name__}: {exc}") from None
            fut = asyncio.get_running_loop().create_future()
            p.pending[job_id] = fut
            if p.alive:
                p.proc.stdin.write(frame)  # type: ignore[union-attr]
            else:  # died since _ensure: the reader fails what is pending (or has already)
                p.pending.pop(job_id)
                raise AgentWorkerDied(f"the agent's worker process (pid {p.proc.pid}) died before the episode "
                                      "could start in it")
            try:
                return await fut
            finally:
                if p.pending.pop(job_id, None) is not None:  # no answer yet: cancelled (a timeout)
                    with contextlib.suppress(Exception):
                        p.send(("cancel", job_id))
        finally:
            self.load[slot] -= 1

    def stats(self) -> dict[str, float]:
        return {"rollout/agent_worker_starts": float(self.num_started),
                "rollout/agent_worker_deaths": float(self.num_died)}

    async def close(self) -> None:
        """Close every worker's stdin (it exits), kill any still there after ``close_grace_s``,
        and reap them all: no process is left. Safe to call twice."""
        self._closed = True
        procs = [p for p in self.procs if p is not None]
        self.procs = [None] * self.num_workers
        for p in procs:
            if p.proc.stdin is not None and not p.proc.stdin.is_closing():
                p.proc.stdin.close()

        async def reap(p: _Process) -> None:
            try:
                await asyncio.wait_for(p.proc.wait(), self.close_grace_s)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.kill()
                await p.proc.wait()
            if p.reader is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(p.reader, 15.0)

        await asyncio.gather(*(reap(p) for p in procs))
