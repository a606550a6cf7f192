"""env/: the interface between a run and its environment: how a config names one, and the check.

An env is a Gymnasium env whose ``reset()`` returns chat messages and whose ``step(text)`` takes the
assistant's text and never raises (the contract, its base classes and the built-in envs are
:mod:`agentrl.envs`). A config names it as ``[module:]EnvId``: :func:`import_env_module` imports the
module that registers it, :func:`check_env` also makes it once (a bad id or kwargs is a
:class:`~agentrl.config.ConfigError` before any actor starts), and :func:`env_module_path` names what
must travel to a cluster's other nodes. Knows nothing of Ray, vLLM or the trainer.
"""

from agentrl.env.ids import check_env, env_module_path, import_env_module, split_env_id

__all__ = ["check_env", "env_module_path", "import_env_module", "split_env_id"]
