"""The driver's side of fault handling: deadlines with a diagnosis, and what it restarts.

:class:`Supervisor` holds the run's actors (:class:`agentrl.driver.state.RunActors`) and its
watchdog: waits under deadlines (a batch, a learner step, any ``ray.get``), the recovery that the
watchdog calls when a deadline passes (restart a frozen engine, replace a dead or frozen rollout
actor), and the catch-up of an engine that Ray restarted with older weights (through the weights
service, :class:`agentrl.weights.sync.WeightService`, for which it is the ``Waits``).
:class:`SigtermAsInterrupt` turns a SIGTERM into the Ctrl-C that stops a run cleanly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from agentrl.driver.state import RunActors
from agentrl.driver.watchdog import ActorReport, RunStalled, RunStopped

if TYPE_CHECKING:
    from agentrl.config import Config
    from agentrl.weights.sync import WeightService

__all__ = ["SigtermAsInterrupt", "Supervisor"]


# A stop signal's text, kept until it is given back: Python drops an exception raised where it
# cannot propagate (a finalizer the garbage collector runs: "Exception ignored in ..."), so a
# signal that lands there would otherwise be lost; the driver's loop checks this at every step.
_SIGNALLED: list[str] = []


def _stop_as_on_ctrl_c(signum: int, _frame: Any) -> None:
    why = f"stopped by signal {signal.Signals(signum).name}"
    _SIGNALLED.append(why)
    raise KeyboardInterrupt(why)


def stop_if_signalled() -> None:
    """Raise the KeyboardInterrupt of a SIGTERM taken since :meth:`SigtermAsInterrupt.take` (again:
    its first raise may have been dropped, see ``_SIGNALLED``). The loops call this at every step."""
    if _SIGNALLED:
        raise KeyboardInterrupt(_SIGNALLED[-1])


class SigtermAsInterrupt:
    """From :meth:`take` to :meth:`give_back` (shutdown), a SIGTERM (what `kill`, `timeout`, job
    schedulers and container runtimes send) stops the run as Ctrl-C does: a KeyboardInterrupt
    unwinds to ``shutdown``, which kills the actors and removes the run's temp files. Taken after
    ``ray.init``: the handler Ray's driver installs there ends the process at once (exit -6),
    which left Ray's agent processes, the engine's temp dir and the run's compile cache behind
    (bench/soak.py, 2026-11-27). Main thread only (Python's rule for handlers)."""

    def __init__(self) -> None:
        self._before: Any = None

    def take(self) -> None:
        if threading.current_thread() is threading.main_thread():
            _SIGNALLED.clear()
            self._before = signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c)

    def give_back(self) -> None:
        if self._before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._before)
            self._before = None
            _SIGNALLED.clear()


def _still_running(procs: list[Any], timeout_s: float) -> list[int]:
    """Pids of ``procs`` still running after up to ``timeout_s`` (a zombie is dead: it waits only
    for whoever adopted it to reap it)."""
    import psutil

    end = time.monotonic() + timeout_s
    while True:
        left = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p.pid)
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.1)


class Supervisor:
    """Fault handling of one run (see the module docstring).

    Args:
        cfg: the run config (``watchdog``, ``replay.groups_per_step``, ``learner.num_gpus``).
        actors: the run's actors; rollout actors are replaced in it.
        make_rollout: builds rollout actor ``i`` (its generation read from ``actors.rollout_generation``).
        ckpt_dir: where checkpoints go (named in a stopped run's message).
        overlap: whether the loop queues a step on the learner before the last one ends.
        engine_start_s: how long the engines took to start (a restart's grace; None: ``watchdog.first_s``).
    """

    def __init__(self, cfg: Config, actors: RunActors, *, make_rollout: Callable[[int], Any], ckpt_dir: Path,
                 overlap: bool, engine_start_s: float | None = None) -> None:
        self.cfg, self.actors, self.make_rollout, self.ckpt_dir = cfg, actors, make_rollout, ckpt_dir
        self.overlap, self.engine_start_s = overlap, engine_start_s
        self.weights: WeightService | None = None  # the run's weights service, once it is built (set by the trainer)
        self.engine_restarts = self.rollout_restarts = self.abandoned_groups = 0
        self._engine_pings: dict[int, tuple[Any, int]] = {}  # check_engines: (ping, engines_version when sent)
        self._progress_counts: tuple[float, float] | None = None  # progress: (put, dropped stale) last look
        self._fresh_looks = 0

    @property
    def watchdog(self) -> Any:
        return self.actors.watchdog

    # -- waits ------------------------------------------------------------------------------------
    def get(self, kind: str, refs: Any, what: str, *, recover: bool = True, focus: tuple[str, ...] = (),
            progress: bool | Any = False) -> Any:
        """ray.get under the watchdog (before it starts: a plain ray.get). ``progress``: True for the
        replay queue's (a batch), or a function of its own (see Watchdog.wait)."""
        if self.watchdog is None:
            return ray.get(refs)
        look = progress if callable(progress) else (self.progress if progress else None)
        return self.watchdog.get(kind, refs, what=what, recover=self.recover if recover else None, focus=focus,
                                 progress=look)

    def result(self, kind: str, future: Future, what: str) -> Any:
        """A future's result under the watchdog: a frozen engine holding it is killed, and what
        waits on it goes on without that engine."""
        if self.watchdog is None:
            return future.result()
        return self.watchdog.result(kind, future, what=what, recover=self.recover, focus=self.actors.engine_names())

    def on_engines(self, kind: str, method: str, *args: Any) -> int:
        """Call ``method`` on every engine under the watchdog; an engine that died (and was
        restarted by Ray) is asked once more. Returns how many were asked again."""
        engines, again = self.actors.engines, 0
        refs = [getattr(e, method).remote(*args) for e in engines]
        for i, ref in enumerate(refs):
            try:
                self.get(kind, ref, f"engine{i}.{method}", focus=(f"engine{i}",))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                again += 1
                self.get(kind, getattr(engines[i], method).remote(*args), f"engine{i}.{method} (restarted)",
                         focus=(f"engine{i}",))
        return again

    def take(self, take: Any, *, step: int, version: int, on_stall: Callable[[], Path] | None = None) -> list[Any]:
        """The batch ``take`` (a replay.take call) for step ``step + 1``, under the watchdog: no group
        arriving for too long is diagnosed, frozen engines are restarted and lost rollout actors
        replaced; a dead rollout actor is noticed (and replaced) without waiting for the deadline,
        and a restarted engine is given the weights of ``version``. A stall stops the run, after
        ``on_stall`` (a checkpoint save; None where a step is queued behind this batch)."""
        if self.watchdog is None or not self.cfg.watchdog.enabled:
            while not ray.wait([take], timeout=2.0)[0]:
                if not self.overlap:
                    self.check_engines(version)
            return ray.get(take)
        k = self.cfg.replay.groups_per_step

        def done(timeout: float) -> bool:
            end = time.perf_counter() + timeout
            while True:
                if ray.wait([take], timeout=min(2.0, max(0.0, end - time.perf_counter())))[0]:
                    return True
                self.check_rollouts()
                if not self.overlap:  # (overlapped: a step waits on the learner for this batch)
                    self.check_engines(version)
                if time.perf_counter() >= end:
                    return False

        try:
            self.watchdog.wait("batch", done, what=f"a batch of {k} groups for step {step + 1} (replay.take)",
                               recover=self.recover, progress=self.progress,
                               focus=(*self.actors.engine_names(), *(f"rollout{i}" for i in range(len(self.actors.rollouts)))))
        except RunStalled as exc:
            if on_stall is None:  # a step is queued on the learner behind this batch: a save would wait for it
                raise
            try:
                path = on_stall()
            except Exception as err:  # noqa: BLE001 (the stall is the error to report)
                raise RunStalled(f"{exc}\n(no checkpoint could be saved: {type(err).__name__}: {err})") from exc
            raise RunStalled(f"{exc}\nthe learner's state after step {step} was saved to {path}; "
                             "`agentrl train CONFIG --resume` continues from it") from exc
        return ray.get(take)

    def learner_step(self, ref: Any, groups: list[Any], *, step: int) -> dict[str, Any]:
        """Learner step ``step + 1`` (``ref``) under the watchdog. The learner's state cannot be
        rebuilt elsewhere: if it dies or freezes the run stops, naming the cause, and --resume
        continues from the last checkpoint."""
        try:
            if self.watchdog is None:
                return ray.get(ref)
            # A CPU learner that keeps burning CPU is slow, not stuck (a loaded machine); on a GPU a
            # hung collective spins the CPU too, so there the deadline alone decides.
            progress = self.learner_cpu if self.cfg.learner.num_gpus == 0 else None
            return self.watchdog.get("learner_step", ref, what=f"learner step {step + 1}",
                                     focus=self.actors.learner_names(), progress=progress)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, RunStalled) as exc:
            n = sum(len(g.trajectories) for g in groups)
            cause = (f"the learner died during step {step + 1} ({type(exc).__name__}: {str(exc)[:500]})"
                     if not isinstance(exc, RunStalled) else str(exc))
            raise RunStopped(f"{cause}\n{self.resume_hint(step)} The {len(groups)} groups ({n} trajectories) of the "
                             "unfinished step were consumed and not trained on.") from exc

    def learner_cpu(self) -> Any:
        """CPU seconds the learner processes have used, to a tenth (None if not on this host): a
        learner starved on a loaded machine still moves it; one blocked for good does not."""
        import psutil

        total = 0.0
        for name in self.actors.learner_names():
            pid = self.watchdog.pids.get(name)
            try:
                t = psutil.Process(pid).cpu_times() if pid and self.watchdog.is_same_process(name, pid) else None
            except psutil.Error:
                t = None
            if t is None:
                return None
            total += t.user + t.system
        return round(total, 1)

    def progress(self) -> Any:
        """What changes while rollouts make progress towards the batch: a count of the looks (the
        watchdog looks at each deadline) between which more groups were queued than dropped as
        stale (None if the replay actor does not answer).

        Not admissions (a frozen engine still lets groups be admitted), nor groups given back after
        failing, nor groups dropped as stale: an engine that cannot start fails every group, and a
        restarted engine serving old weights makes only stale ones, both forever; counting them
        kept the watchdog quiet while the run made no step (seen in a GPU chaos run)."""
        try:
            m = ray.get(self.actors.replay.metrics.remote(), timeout=self.cfg.watchdog.ping_timeout_s)
        except Exception:  # noqa: BLE001 (judged by the diagnosis)
            return None
        counts = (m.get("replay/put", 0.0), m.get("replay/dropped_stale", 0.0))
        last, self._progress_counts = self._progress_counts, counts
        if last is not None and counts[0] - last[0] > counts[1] - last[1]:
            self._fresh_looks += 1
        return self._fresh_looks

    def sampling_progress(self) -> Any:
        """What changes while the engines sample (an evaluation's progress, which no queue counts):
        each engine's count of tokens sampled so far; None if one does not answer. A slow machine
        keeps it moving; a frozen engine (or a hung agent) does not."""
        try:
            statuses = ray.get([e.ping.remote() for e in self.actors.engines], timeout=self.cfg.watchdog.ping_timeout_s)
        except Exception:  # noqa: BLE001 (judged by the diagnosis)
            return None
        return tuple(s.get("tokens_sampled") for s in statuses)

    # -- recovery ---------------------------------------------------------------------------------
    def replace_rollout(self, i: int, why: str) -> None:
        """A rollout actor died or froze: kill it, give its replay slots back (its groups in flight
        are lost, counted as replay/abandoned) and start a new one in its place."""
        a = self.actors
        old, owner = a.rollouts[i], f"rollout{i}.{a.rollout_generation[i]}"
        with contextlib.suppress(Exception):
            ray.kill(old, no_restart=True)
        lost = ray.get(a.replay.abandon.remote(owner))
        self.abandoned_groups += lost
        a.rollout_generation[i] += 1
        self.watchdog.pids.pop(f"rollout{i}", None)  # the replacement answers from a new process
        a.rollouts[i] = self.make_rollout(i)
        if a.runs:
            a.runs[i] = a.rollouts[i].run.remote()
        self.rollout_restarts += 1
        print(f"agentrl: rollout actor {i} {why}: replaced; {lost} group(s) it had in flight were lost "
              "(replay/abandoned)", file=sys.stderr, flush=True)

    def check_rollouts(self) -> None:
        """Replace a rollout actor whose run() ended by its death; stop on one that raised."""
        for i, ref in enumerate(self.actors.runs):
            if ref is None or not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.replace_rollout(i, f"died ({type(exc).__name__})")
                continue
            except Exception as exc:
                raise RunStopped(f"rollout actor {i} stopped with an error: {type(exc).__name__}: "
                                 f"{str(exc)[:2000]}") from exc
            raise RunStopped(f"rollout actor {i} returned from run() while training went on")

    def kill_frozen(self, report: ActorReport, handle: Any) -> str:
        """Kill an unresponsive or stalled actor's process and its children (an engine's vLLM core,
        which does not end with its parent). Ray's kill asks the process to exit, which a frozen
        (SIGSTOPped, GIL-deadlocked) process cannot do; SIGKILL by pid does, stopped or not.
        Returns what was killed, and any process of it still alive after 10 s."""
        import psutil

        local = report.pid is not None and self.watchdog.is_same_process(report.name, report.pid)  # never a reused pid
        procs: list[Any] = []
        if local:
            with contextlib.suppress(psutil.Error):
                procs = psutil.Process(report.pid).children(recursive=True)
        elif report.state == "stalled":  # another node's engine that answers: it kills its own core
            with contextlib.suppress(Exception):
                ray.get(handle.kill_core.remote(), timeout=self.cfg.watchdog.ping_timeout_s)
        for p in procs:  # the children first: once the actor is gone they are harder to find
            with contextlib.suppress(psutil.Error, OSError):
                p.send_signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=False)
        if local:
            with contextlib.suppress(psutil.Error, OSError):
                procs.append(psutil.Process(report.pid))
                os.kill(report.pid, signal.SIGKILL)
        left = _still_running(procs, timeout_s=10.0)
        killed = ", ".join(str(p.pid) for p in procs) or "none found on this host"
        return f"SIGKILLed pids {killed}" + (f"; STILL ALIVE: {left}" if left else "; none left")

    def recover(self, reports: list[ActorReport]) -> bool:
        """What the watchdog can do about a stall: restart frozen engines (Ray restarts them; they
        load the staged weights) and replace frozen or dead rollout actors. False where nothing
        it may restart is at fault (the learner or the replay queue: their state would be lost)."""
        acted = restarting = fatal = False
        named = self.actors.named()
        for r in reports:
            gone = r.pid is not None and not self.watchdog.process_alive(r.name, r.pid)
            if r.state == "unresponsive" and r.pid is None and not r.name.startswith(("learner", "replay")):
                # a new actor (a replacement) that has not answered yet: it is still being built
                r.action, acted, restarting = "starting (has not answered yet); waiting", True, True
            elif r.name.startswith(("engine", "teacher")) and r.state == "unresponsive" and gone:
                # its process is gone: Ray is restarting it (a new process does not answer until
                # its actor is built); killing it again would only start that over
                r.action, acted, restarting = "its process is gone: Ray is restarting it; waiting", True, True
            elif r.name.startswith(("engine", "teacher")) and r.state in ("unresponsive", "stalled"):
                # stalled: its actor answers but its core samples nothing (frozen, a hung kernel or
                # collective); its requests in flight fail with the actor, and their groups are
                # released (or put with their other episodes) by the rollout actors
                killed = self.kill_frozen(r, named[r.name])
                self.watchdog.ledger.forget(r.name)
                self.engine_restarts += 1
                r.action, acted = f"killed; Ray restarts it and it loads the current weights ({killed})", True
                restarting = True
                print(f"agentrl: {r.name} {r.state} ({r.error}); {r.status.get('core', 'no core process found')}: "
                      f"restarting it: {killed}", file=sys.stderr, flush=True)
            elif r.name.startswith(("engine", "teacher")) and r.state == "dead":
                r.action, acted, restarting = "restarting (Ray)", True, True
            elif r.name.startswith(("engine", "teacher")) and r.status.get("start_error"):
                # a restarted engine whose vLLM cannot start (e.g. the colocated learner holds the
                # memory it asks for): every call on it fails; waiting changes nothing
                r.action, fatal = "its vLLM fails to start (restarted): the run cannot go on without it", True
            elif (r.name.startswith("engine") and r.status.get("started")
                  and r.status.get("version", self._engines_version()) < self._engines_version()):
                # restarted without the weights (a GPU transport stages none): its groups are stale
                fixable = not self.overlap and self.weights is not None and self.weights.transport != "nccl"
                r.action = (f"serves weights version {r.status.get('version')}, older than the run's "
                            f"{self._engines_version()} (restarted without them): "
                            + ("the driver loads the current ones between waits" if fixable else
                               "nothing loads them before the next refit (overlapped steps or nccl), which "
                               "waits for this batch"))
            elif r.name.startswith(("engine", "teacher")) and r.status.get("started") is False:
                r.action, acted, restarting = "starting vLLM (restarted); waiting for it", True, True
            elif r.name.startswith("rollout") and r.state in ("unresponsive", "dead"):
                if r.state == "unresponsive" and not gone:
                    self.kill_frozen(r, named[r.name])
                self.replace_rollout(int(r.name[len("rollout"):]), "was " + r.state)
                r.action, acted = "replaced; its groups in flight are counted as abandoned", True
        if not acted and all(r.state in ("idle", "busy") for r in reports):
            # Nothing frozen or lost, every actor answers: a slow machine is more likely than a
            # hang. Wait again; watchdog.max_recoveries such waits in a row stop the run.
            for r in reports:
                if r.state == "busy":
                    r.action = "busy and answering: waiting again"
            acted = True
        if restarting:
            self.restart_grace()
        return acted and not fatal

    def restart_grace(self) -> None:
        """An engine restarts: no deadline passes for twice as long as the engines took to start
        (a longer grace would hide the next fault), and the waits it spans are not taken as the
        run's usual timings."""
        wc = self.cfg.watchdog
        start = self.engine_start_s or wc.first_s
        self.watchdog.grace(min(wc.first_s, max(wc.floor_s, 2 * start)))

    def check_engines(self, version: int) -> None:
        """Give a restarted engine the current weights: between waits for a batch, read the engines'
        pings (sent last time, never waited for) and load the learner's weights into one that
        started but serves an older version than the others.

        An engine restarted by Ray catches up by itself from the weights staged in the weight store,
        but only object-store refits are staged: with CUDA IPC (colocated) or NCCL it comes up with
        its start weights, every group it makes is dropped as stale, and no batch ever comes (the
        next refit, which would fix it, waits for that batch)."""
        weights = self.weights
        if weights is None:
            return
        if weights.refit_in_flight():
            self._engine_pings.clear()  # the refit in flight loads every engine, a restarted one too
            return
        for i, engine in enumerate(self.actors.engines):
            ref, sent_at = self._engine_pings.pop(i, (None, None))
            if ref is None or sent_at != weights.engines_version:
                # only an answer to a ping sent after the last refit ended tells a restarted engine
                # from one that had not loaded that refit yet
                self._engine_pings[i] = (engine.ping.remote(), weights.engines_version)
                continue
            if not ray.wait([ref], timeout=0)[0]:
                self._engine_pings[i] = (ref, sent_at)  # restarting (vLLM loads): read it next time
                continue
            try:
                status = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                continue  # died or restarting: pinged again next time
            served = int(status.get("version", weights.engines_version))
            if status.get("started") and served < weights.engines_version:
                self.catch_up_engine(i, served, version)

    def catch_up_engine(self, i: int, served: int, version: int) -> None:
        """Load the learner's current weights (``version``) into engine ``i`` alone, which serves
        ``served``; the learner is idle (no step is queued while the driver waits for a batch)."""
        weights = self.weights
        if weights.transport == "nccl":
            raise RunStopped(
                f"engine{i} was restarted and serves weights version {served}, older than the run's "
                f"{weights.engines_version}: the nccl transport cannot bring a restarted engine into its weight "
                f"group, and groups sampled with its weights are all stale.\n{self.resume_hint(version)}")
        print(f"agentrl: engine{i} was restarted and serves weights version {served}, older than the run's "
              f"{weights.engines_version}; loading the current weights (version {version}) into it",
              file=sys.stderr, flush=True)
        if self.watchdog is not None:
            self.restart_grace()  # this wait spanned the restart: not a usual batch time
        weights.catch_up(i, version)

    def _engines_version(self) -> int:
        return self.weights.engines_version if self.weights is not None else 0

    def resume_hint(self, step: int) -> str:
        """What a stopped run (at ``step``) lost, and how to continue."""
        latest = self.ckpt_dir / "latest"
        since = latest.read_text().strip() if latest.is_file() else None
        return (f"the run stopped at step {step}: the learner's state since "
                + (f"its last checkpoint ({self.ckpt_dir / since}) is lost; `agentrl train CONFIG --resume` "
                   "continues from there." if since else "the start is lost (no checkpoint yet; train."
                   "checkpoint_interval); start again."))

    def fault_metrics(self) -> dict[str, float]:
        wd, w = self.watchdog, self.weights
        return {
            "faults/watchdog_alarms": float(wd.num_alarms if wd else 0),
            "faults/recoveries": float(wd.num_recoveries if wd else 0),
            "faults/engine_restarts": float(self.engine_restarts),
            "faults/rollout_restarts": float(self.rollout_restarts),
            "faults/refit_retries": float(w.refit_retries if w else 0),
            "faults/engine_catch_ups": float(w.engine_catch_ups if w else 0),
        }
