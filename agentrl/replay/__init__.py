"""replay/: the replay queue between rollouts and the learner (admission, staleness, batching).

Pure and synchronous state (:class:`ReplayQueue`); the Ray actor that turns its "not now" answers
into waiting is :mod:`agentrl.actors.replay`. Knows nothing of Ray, engines or learners.
"""

from agentrl.replay.queue import DynamicSamplingStalled, ReplayQueue, ReplayStats

__all__ = ["DynamicSamplingStalled", "ReplayQueue", "ReplayStats"]
