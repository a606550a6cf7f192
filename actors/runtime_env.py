"""The Ray runtime environment of a run: ``cluster.runtime_env`` plus the user's env module (and
the modules of a ``module:name`` loss, advantage estimator or learner backend).

On one machine, Ray's workers import what the driver's working directory holds; on a cluster
they do not, so the package (or file) named by ``env.id=module:EnvId`` is added to
``py_modules`` (unless it is installed, or ``cluster.ship_env_module=false``): Ray uploads it
once and puts it on the path of every worker of the job, on any node. Ray accepts local paths
only at the job level, so the result is given to ``ray.init`` (by the trainer, or by a caller
that starts Ray itself: ``ray.init(..., runtime_env=trainer.runtime_env)``).

Knows nothing of the trainer's loop or of the actors it is given to.
"""

from __future__ import annotations

import difflib
from typing import Any

from agentrl.config import Config, ConfigError
from agentrl.env.ids import env_module_path

__all__ = ["build_runtime_env"]


def build_runtime_env(cfg: Config) -> dict[str, Any]:
    """``cluster.runtime_env`` with the env's module added to ``py_modules``; checked by Ray's own
    validation, so a typo fails here, before any actor starts.

    Call it after the env module is imported (:func:`agentrl.env.ids.check_env`), and the modules
    of ``module:name`` components (:func:`agentrl.config.registry.check_components`).

    Raises:
        ConfigError: naming ``cluster.runtime_env`` (with a did-you-mean for a misspelled key).
    """
    from ray.runtime_env import RuntimeEnv

    runtime_env = dict(cfg.cluster.runtime_env)
    public = sorted(k for k in RuntimeEnv.known_fields if not k.startswith("_"))
    for key in runtime_env:
        if key not in RuntimeEnv.known_fields:
            # Unknown keys may be runtime-env plugins of the cluster; a near miss is a typo.
            hint = difflib.get_close_matches(key, public, n=1)
            if hint:
                raise ConfigError(f"cluster.runtime_env: unknown key '{key}'; did you mean '{hint[0]}'? "
                                  f"(Ray's keys: {', '.join(public)})")
    specs = [cfg.env.id] if cfg.agent.solve is None or cfg.sft.enabled else []
    # The agent's modules travel as env modules do (agent.tasks may be a file path: not a module).
    specs += [s for s in (cfg.agent.solve, cfg.agent.score, cfg.agent.tasks, cfg.agent.eval_tasks)
              if s and ":" in s and "/" not in s and not s.endswith((".jsonl", ".json"))]
    # so do the modules of a user's loss, advantage estimator and learner backend (module:name)
    specs += [s for s in (cfg.loss.type, cfg.advantage.estimator, cfg.learner.backend) if ":" in s]
    for spec in specs if cfg.cluster.ship_env_module else []:
        module_path = env_module_path(spec)
        if module_path is None:
            continue
        if not isinstance(runtime_env.get("py_modules") or [], list):
            raise ConfigError("cluster.runtime_env.py_modules must be a list of paths or URIs, "
                              f"got {runtime_env['py_modules']!r}")
        shipped = [str(p) for p in runtime_env.get("py_modules") or []]
        if str(module_path) not in shipped:
            runtime_env["py_modules"] = [*shipped, str(module_path)]
    try:
        RuntimeEnv(**runtime_env)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"cluster.runtime_env: {exc}") from None
    return runtime_env
