"""The driver's side of fault handling: deadlines with a diagnosis, and what it restarts.

:class:`Supervision` is a part of :class:`agentrl.driver.trainer.Trainer` (a mixin over the driver's
state: its actors, watchdog, versions and counters): waits under the watchdog, the recovery that
the watchdog calls when a deadline passes (restart a frozen engine, replace a dead or frozen
rollout actor), and the catch-up of an engine that Ray restarted with older weights. The driver's
loop and refits stay in ``trainer.py``; this module never imports it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any

import ray

from agentrl.driver.watchdog import ActorReport, RunStopped

__all__ = ["Supervision"]


# A stop signal's text, kept until shutdown: Python drops an exception raised where it cannot
# propagate (a finalizer the garbage collector runs: "Exception ignored in ..."), so a signal that
# lands there would otherwise be lost; the driver's loop checks this at every step.
_SIGNALLED: list[str] = []


def _stop_as_on_ctrl_c(signum: int, _frame: Any) -> None:
    why = f"stopped by signal {signal.Signals(signum).name}"
    _SIGNALLED.append(why)
    raise KeyboardInterrupt(why)


def _still_running(procs: list[Any], timeout_s: float) -> list[int]:
    """Pids of ``procs`` still running after up to ``timeout_s`` (a zombie is dead: it waits only
    for whoever adopted it to reap it)."""
    import time

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


class Supervision:
    """Fault handling of the driver (see the module docstring); the attributes it reads are the
    Trainer's (``engines``, ``rollouts``, ``replay``, ``watchdog``, ``engines_version`` ...)."""

    def _take_sigterm(self) -> None:
        """From here to ``_give_back_sigterm`` (shutdown), a SIGTERM (what `kill`, `timeout`, job
        schedulers and container runtimes send) stops the run as Ctrl-C does: a KeyboardInterrupt
        unwinds to ``shutdown``, which kills the actors and removes the run's temp files. Called
        after ``ray.init``: the handler Ray's driver installs there ends the process at once (exit
        -6), which left Ray's agent processes, the engine's temp dir and the run's compile cache
        behind (bench/soak.py, 2026-11-27). Main thread only (Python's rule for handlers)."""
        if threading.current_thread() is threading.main_thread():
            _SIGNALLED.clear()
            self._sigterm_before = signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c)

    def _stop_if_signalled(self) -> None:
        """Raise the KeyboardInterrupt of a SIGTERM taken since ``_take_sigterm`` (again: its first
        raise may have been dropped, see ``_SIGNALLED``). The loop calls this at every step."""
        if _SIGNALLED:
            raise KeyboardInterrupt(_SIGNALLED[-1])

    def _give_back_sigterm(self) -> None:
        before = getattr(self, "_sigterm_before", None)
        if before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, before)
            self._sigterm_before = None
            _SIGNALLED.clear()

    def _replace_rollout(self, i: int, why: str) -> None:
        """A rollout actor died or froze: kill it, give its replay slots back (its groups in flight
        are lost, counted as replay/abandoned) and start a new one in its place."""
        old, owner = self.rollouts[i], f"rollout{i}.{self.rollout_generation[i]}"
        with contextlib.suppress(Exception):
            ray.kill(old, no_restart=True)
        lost = ray.get(self.replay.abandon.remote(owner))
        self.num_abandoned_groups += lost
        self.rollout_generation[i] += 1
        self.watchdog.pids.pop(f"rollout{i}", None)  # the replacement answers from a new process
        self.rollouts[i] = self._make_rollout(i)
        if self.runs:
            self.runs[i] = self.rollouts[i].run.remote()
        self.num_rollout_restarts += 1
        print(f"agentrl: rollout actor {i} {why}: replaced; {lost} group(s) it had in flight were lost "
              "(replay/abandoned)", file=sys.stderr, flush=True)

    def _check_rollouts(self) -> None:
        """Replace a rollout actor whose run() ended by its death; stop on one that raised."""
        for i, ref in enumerate(self.runs):
            if ref is None or not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self._replace_rollout(i, f"died ({type(exc).__name__})")
                continue
            except Exception as exc:
                raise RunStopped(f"rollout actor {i} stopped with an error: {type(exc).__name__}: "
                                 f"{str(exc)[:2000]}") from exc
            raise RunStopped(f"rollout actor {i} returned from run() while training went on")

    def _kill_frozen(self, report: ActorReport, handle: Any) -> str:
        """Kill an unresponsive or stalled actor's process and its children (an engine's vLLM core,
        which does not end with its parent). Ray's kill asks the process to exit, which a frozen
        (SIGSTOPped, GIL-deadlocked) process cannot do; SIGKILL by pid does, stopped or not.
        Returns what was killed, and any process of it still alive after 10 s."""
        import signal

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

    def _recover(self, reports: list[ActorReport]) -> bool:
        """What the watchdog can do about a stall: restart frozen engines (Ray restarts them; they
        load the staged weights) and replace frozen or dead rollout actors. False where nothing
        it may restart is at fault (the learner or the replay queue: their state would be lost)."""
        acted = restarting = fatal = False
        named = self.named_actors()
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
                killed = self._kill_frozen(r, named[r.name])
                self.watchdog.ledger.forget(r.name)
                self.num_engine_restarts += 1
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
                  and r.status.get("version", self.engines_version) < self.engines_version):
                # restarted without the weights (a GPU transport stages none): its groups are stale
                fixable = not self.overlap_steps() and self.transport != "nccl"
                r.action = (f"serves weights version {r.status.get('version')}, older than the run's "
                            f"{self.engines_version} (restarted without them): "
                            + ("the driver loads the current ones between waits" if fixable else
                               "nothing loads them before the next refit (overlapped steps or nccl), which "
                               "waits for this batch"))
            elif r.name.startswith(("engine", "teacher")) and r.status.get("started") is False:
                r.action, acted, restarting = "starting vLLM (restarted); waiting for it", True, True
            elif r.name.startswith("rollout") and r.state in ("unresponsive", "dead"):
                if r.state == "unresponsive" and not gone:
                    self._kill_frozen(r, named[r.name])
                self._replace_rollout(int(r.name[len("rollout"):]), "was " + r.state)
                r.action, acted = "replaced; its groups in flight are counted as abandoned", True
        if not acted and all(r.state in ("idle", "busy") for r in reports):
            # Nothing frozen or lost, every actor answers: a slow machine is more likely than a
            # hang. Wait again; watchdog.max_recoveries such waits in a row stop the run.
            for r in reports:
                if r.state == "busy":
                    r.action = "busy and answering: waiting again"
            acted = True
        if restarting:
            self._restart_grace()
        return acted and not fatal

    def _restart_grace(self) -> None:
        """An engine restarts: no deadline passes for twice as long as the engines took to start
        (a longer grace would hide the next fault), and the waits it spans are not taken as the
        run's usual timings."""
        wc = self.cfg.watchdog
        start = self.engine_start_s or wc.first_s
        self.watchdog.grace(min(wc.first_s, max(wc.floor_s, 2 * start)))

    def _progress(self) -> Any:
        """What changes while rollouts make progress towards the batch: a count of the looks (the
        watchdog looks at each deadline) between which more groups were queued than dropped as
        stale (None if the replay actor does not answer).

        Not admissions (a frozen engine still lets groups be admitted), nor groups given back after
        failing, nor groups dropped as stale: an engine that cannot start fails every group, and a
        restarted engine serving old weights makes only stale ones, both forever; counting them
        kept the watchdog quiet while the run made no step (seen in a GPU chaos run)."""
        try:
            m = ray.get(self.replay.metrics.remote(), timeout=self.cfg.watchdog.ping_timeout_s)
        except Exception:  # noqa: BLE001 (judged by the diagnosis)
            return None
        counts = (m.get("replay/put", 0.0), m.get("replay/dropped_stale", 0.0))
        last, self._progress_counts = self._progress_counts, counts
        if last is not None and counts[0] - last[0] > counts[1] - last[1]:
            self._fresh_looks += 1
        return self._fresh_looks

    def _sampling_progress(self) -> Any:
        """What changes while the engines sample (an evaluation's progress, which no queue counts):
        each engine's count of tokens sampled so far; None if one does not answer. A slow machine
        keeps it moving; a frozen engine (or a hung agent) does not."""
        try:
            statuses = ray.get([e.ping.remote() for e in self.engines], timeout=self.cfg.watchdog.ping_timeout_s)
        except Exception:  # noqa: BLE001 (judged by the diagnosis)
            return None
        return tuple(s.get("tokens_sampled") for s in statuses)

    def _get(self, kind: str, refs: Any, what: str, *, recover: bool = True, focus: tuple[str, ...] = (),
             progress: bool | Any = False) -> Any:
        """ray.get under the watchdog (before start(): a plain ray.get). ``progress``: True for the
        replay queue's (a batch), or a function of its own (see Watchdog.wait)."""
        if self.watchdog is None:
            return ray.get(refs)
        look = progress if callable(progress) else (self._progress if progress else None)
        return self.watchdog.get(kind, refs, what=what, recover=self._recover if recover else None, focus=focus,
                                 progress=look)

    def _engine_names(self) -> tuple[str, ...]:
        return tuple(f"engine{i}" for i in range(len(self.engines)))

    def _learner_names(self) -> tuple[str, ...]:
        return tuple(f"learner{i}" for i in range(len(self.learner.actors)))

    def _on_engines(self, kind: str, method: str, *args: Any) -> None:
        """Call ``method`` on every engine under the watchdog; an engine that died (and was
        restarted by Ray) is asked once more."""
        refs = [getattr(e, method).remote(*args) for e in self.engines]
        for i, ref in enumerate(refs):
            try:
                self._get(kind, ref, f"engine{i}.{method}", focus=(f"engine{i}",))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                self.engines_unavailable_at_refit += 1
                self._get(kind, getattr(self.engines[i], method).remote(*args), f"engine{i}.{method} (restarted)",
                          focus=(f"engine{i}",))

    def _check_engines(self) -> None:
        """Give a restarted engine the current weights: between waits for a batch, read the engines'
        pings (sent last time, never waited for) and load the learner's weights into one that
        started but serves an older version than the others.

        An engine restarted by Ray catches up by itself from the weights staged in the replay actor,
        but only object-store refits are staged: with CUDA IPC (colocated) or NCCL it comes up with
        its start weights, every group it makes is dropped as stale, and no batch ever comes (the
        next refit, which would fix it, waits for that batch)."""
        if self._refit_future is not None and not self._refit_future.done():
            self._engine_pings.clear()  # the refit in flight loads every engine, a restarted one too
            return
        for i, engine in enumerate(self.engines):
            ref, sent_at = self._engine_pings.pop(i, (None, None))
            if ref is None or sent_at != self.engines_version:
                # only an answer to a ping sent after the last refit ended tells a restarted engine
                # from one that had not loaded that refit yet
                self._engine_pings[i] = (engine.ping.remote(), self.engines_version)
                continue
            if not ray.wait([ref], timeout=0)[0]:
                self._engine_pings[i] = (ref, sent_at)  # restarting (vLLM loads): read it next time
                continue
            try:
                status = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                continue  # died or restarting: pinged again next time
            served = int(status.get("version", self.engines_version))
            if status.get("started") and served < self.engines_version:
                self._catch_up_engine(i, served)

    def _catch_up_engine(self, i: int, served: int) -> None:
        """Load the learner's current weights (version ``self.version``) into engine ``i`` alone;
        the learner is idle (no step is queued while the driver waits for a batch)."""
        if self.transport == "nccl":
            raise RunStopped(
                f"engine{i} was restarted and serves weights version {served}, older than the run's "
                f"{self.engines_version}: the nccl transport cannot bring a restarted engine into its weight "
                f"group, and groups sampled with its weights are all stale.\n{self._resume_hint()}")
        print(f"agentrl: engine{i} was restarted and serves weights version {served}, older than the run's "
              f"{self.engines_version}; loading the current weights (version {self.version}) into it",
              file=sys.stderr, flush=True)
        if self.watchdog is not None:
            self._restart_grace()  # this wait spanned the restart: not a usual batch time
        payload = self._export()
        if self.transport == "object_store":
            ray.get(self.replay.stage_weights.remote(self.version, [payload]))
        else:
            payload = ray.get(payload)
        try:
            self._get("refit", self.engines[i].update_weights.remote(payload, self.version, self.cfg.refit.mode),
                      f"engine{i}.update_weights (catching up a restarted engine)", focus=(f"engine{i}",))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            self.engines_unavailable_at_refit += 1  # died again: it is asked again once it answers
        finally:
            if self.transport != "object_store":
                self._release_ref = self.learner.release_refit.remote(getattr(payload, "generation", None))
        self.num_engine_catch_ups += 1

    def _resume_hint(self) -> str:
        latest = self.ckpt_dir / "latest"
        since = latest.read_text().strip() if latest.is_file() else None
        return (f"the run stopped at step {self.step}: the learner's state since "
                + (f"its last checkpoint ({self.ckpt_dir / since}) is lost; `agentrl train CONFIG --resume` "
                   "continues from there." if since else "the start is lost (no checkpoint yet; train."
                   "checkpoint_interval); start again."))

    def _fault_metrics(self) -> dict[str, float]:
        wd = self.watchdog
        return {
            "faults/watchdog_alarms": float(wd.num_alarms if wd else 0),
            "faults/recoveries": float(wd.num_recoveries if wd else 0),
            "faults/engine_restarts": float(self.num_engine_restarts),
            "faults/rollout_restarts": float(self.num_rollout_restarts),
            "faults/refit_retries": float(self.num_refit_retries),
            "faults/engine_catch_ups": float(self.num_engine_catch_ups),
        }
