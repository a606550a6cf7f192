"""Question: what makes Ray's gcs_server RSS and the run's temp dir grow when actors are killed and restarted?

Starts a local Ray cluster the way the trainer does (agentrl.driver.trainer.ray_init_kwargs, in a temp dir
of its own given as TMPDIR and RAY_TMPDIR, as bench/soak.py does), makes one actor with the
engine actor's options (max_restarts=-1, max_task_retries=0, the diag concurrency group), and for
each of ``--cycles`` cycles: makes ``--calls`` calls on it (each a Ray task, each one's events kept
by the GCS), prints ``--log-lines`` lines to the actor's stderr (what a worker logs goes to a file
of its own in Ray's session dir), then SIGKILLs the actor's process (Ray restarts it) or, with
``--replace``, kills it for good and makes a new one (the rollout actor's replacement). After each
cycle it prints gcs_server's RSS and the temp dir's bytes by kind.

    nice -n 19 .venv/bin/python tools/ray_restart_diag.py --cycles 8 --calls 4000
    nice -n 19 .venv/bin/python tools/ray_restart_diag.py --cycles 8 --calls 4000 --system-config '{}'
    nice -n 19 .venv/bin/python tools/ray_restart_diag.py --engine --cycles 4   # the real vLLM engine actor

``--system-config '{}'`` starts Ray with its own defaults instead of the trainer's; ``--engine``
uses agentrl's EngineActor on the tiny model (vLLM on CPU), calling ``generate``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def kinds(tmp: Path) -> dict[str, int]:
    """Bytes under ``tmp`` by kind (bench/soak.py)."""
    from bench.soak import temp_bytes_by_kind

    return temp_bytes_by_kind(tmp)


def gcs_rss_mib() -> float:
    for p in psutil.Process().children(recursive=True):
        try:
            if "gcs_server" in p.name() or "gcs_server" in " ".join(p.cmdline()[:1]):
                return p.memory_info().rss / 2**20
        except psutil.Error:
            pass
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000, help="calls on the actor per cycle (Ray tasks)")
    ap.add_argument("--log-lines", type=int, default=2000, help="lines the actor prints to stderr per cycle")
    ap.add_argument("--replace", action="store_true", help="kill for good and make a new actor (rollout-like)")
    ap.add_argument("--engine", action="store_true", help="the real EngineActor on the tiny model")
    ap.add_argument("--shared-compile-cache", action="store_true",
                    help="--engine: give the engine a compile cache dir of the run's, as the trainer does")
    ap.add_argument("--system-config", default=None,
                    help="JSON for ray.init's _system_config instead of the trainer's ('{}': Ray's defaults)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (its path is printed)")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="raydiag-", dir="/tmp"))
    os.environ["TMPDIR"] = os.environ["RAY_TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    import ray

    from agentrl.driver.trainer import ray_init_kwargs

    kw = ray_init_kwargs(num_cpus=4)
    if args.system_config is not None:
        kw["_system_config"] = json.loads(args.system_config)
    print(f"temp dir {tmp}; ray {ray.__version__}; _system_config {kw.get('_system_config')}", flush=True)
    for attempt in range(5):  # Ray waits 30 s (hard-coded) for its raylet: a starved `nice -n 19` start can miss it
        try:
            ray.init(**kw)
            break
        except Exception as exc:  # "The current node timed out during startup"
            print(f"ray.init failed ({str(exc)[:60]}), again", flush=True)
            ray.shutdown()
            if attempt == 4:
                raise
    try:
        if args.engine:
            from agentrl.actors.engine import EngineActor

            from agentrl.config import EngineConfig
            from agentrl.model.tiny import bootstrap_tiny

            model = str(bootstrap_tiny(tmp / "tiny-model"))

            cache = tempfile.mkdtemp(prefix="agentrl-compile-") if args.shared_compile_cache else None

            def make():
                return EngineActor.options(num_cpus=1, max_restarts=-1, max_task_retries=0).remote(
                    model, EngineConfig(max_model_len=512), compile_cache_dir=cache)

            def work(a, n):
                refs = [a.generate.remote(list(range(5, 25)), 8, 1.0, 1.0) for _ in range(n)]
                ray.get(refs)
        else:
            from agentrl.actors.watchdog import DIAG_GROUPS, AsyncDiag

            @ray.remote(concurrency_groups=DIAG_GROUPS)
            class Plain(AsyncDiag):
                async def call(self, i: int) -> int:
                    return i

                async def log(self, n: int) -> None:
                    for i in range(n):
                        print(f"a worker's log line {i} " + "x" * 80, file=sys.stderr)

            def make():
                return Plain.options(num_cpus=1, max_restarts=-1, max_task_retries=0).remote()

            def work(a, n):
                for start in range(0, n, 500):
                    ray.get([a.call.remote(i) for i in range(start, min(n, start + 500))])
                ray.get(a.log.remote(args.log_lines))

        actor = make()
        pid = ray.get(actor.ping.remote(), timeout=600)["pid"]
        t0 = time.time()
        print(f"{'cycle':>5} {'t_s':>6} {'work_s':>6} {'gcs MiB':>8}  temp MB by kind", flush=True)
        print(f"{0:>5} {0:>6.0f} {0:>6.0f} {gcs_rss_mib():>8.1f}  {json.dumps({k: round(v / 1e6, 2) for k, v in kinds(tmp).items()})}",
              flush=True)
        for c in range(1, args.cycles + 1):
            w0 = time.time()
            work(actor, args.calls)
            work_s = time.time() - w0
            if args.replace:
                ray.kill(actor, no_restart=True)
                actor = make()
            else:
                os.kill(pid, signal.SIGKILL)
            while True:  # the restarted (or new) actor answers from a new process
                try:
                    new = ray.get(actor.ping.remote(), timeout=600)["pid"]
                    if new != pid:
                        pid = new
                        break
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    pass
                time.sleep(0.5)
            if args.engine:
                ray.get(actor.start.remote(), timeout=600)
            time.sleep(2.0)  # the GCS takes in the last task events (reported every second)
            print(f"{c:>5} {time.time() - t0:>6.0f} {work_s:>6.1f} {gcs_rss_mib():>8.1f}  "
                  f"{json.dumps({k: round(v / 1e6, 2) for k, v in kinds(tmp).items()})}", flush=True)
    finally:
        ray.shutdown()
        if not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
