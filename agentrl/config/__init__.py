"""config/: the typed run configuration (pydantic sections, YAML files, dotted overrides).

Every section class, :func:`load_config` and :class:`ConfigError` import from here; the sections
live in ``base``/``learner``/``rollout``/``training`` and the whole config in ``loading``.
Knows nothing of torch, Ray or vLLM, so parsing a config (``--help``, ``--print-config``) is instant.
"""

from agentrl.config import loading as _loading
from agentrl.config.loading import *  # noqa: F403  (the public names are loading's own __all__)

__all__ = list(_loading.__all__)
