"""The two Ray lines that made a healthy quickstart look broken stay away.

* Ray's "Token authentication is enabled for this Ray cluster" warning: a new local cluster turns
  token auth on by default and says so unless ``RAY_AUTH_MODE`` names the mode before Ray is
  imported (``agentrl.driver.pipeline`` names it: ``token``, the same secure default).
* core_worker's ``E`` line "has constructor arguments in the object store and max_restarts > 0":
  a restartable engine actor given the weight store's *handle* (an inlined reference); the
  trainer now passes the weight store's name.

Each case runs in a fresh interpreter (Ray reads ``RAY_AUTH_MODE`` once, at import) and starts a
local cluster as the trainer does; the old wiring is run too, so the test shows it can see both
lines.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
AUTH_LINE = "Token authentication is enabled for this Ray cluster"
RESTART_LINE = "has constructor arguments in the object store"

SCRIPT = textwrap.dedent("""
    import sys
    wiring = sys.argv[1]
    if wiring == "trainer":
        from agentrl.config import load_config
        from agentrl.driver.pipeline import _explicit_ray_auth_mode
        _explicit_ray_auth_mode(load_config(None))
    import ray
    from agentrl.actors.engine import EngineActor
    from agentrl.actors.weights import WeightStoreActor
    from agentrl.config import EngineConfig
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    store = WeightStoreActor.options(num_cpus=0, name="weights-under-test").remote()
    source = "weights-under-test" if wiring == "trainer" else store
    engine = EngineActor.options(num_cpus=0, max_restarts=-1, max_task_retries=0).remote(
        "unused-model-path", EngineConfig(), weight_source=source)
    print("engine version", ray.get(engine.version.remote()))
    ray.shutdown()
""")


def _run(wiring: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, wiring], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "engine version 0" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_trainer_wiring_prints_neither_line() -> None:
    out = _run("trainer")
    assert AUTH_LINE not in out and RESTART_LINE not in out, out[-4000:]


def test_old_wiring_printed_both() -> None:
    out = _run("old")
    assert AUTH_LINE in out and RESTART_LINE in out, out[-4000:]
