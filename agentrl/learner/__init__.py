"""learner/: the learner's math and its backends: losses, advantages, packing, optimizers, LoRA, distillation.

Backends (``torch_learner``, ``megatron``) sit behind one contract (:mod:`agentrl.learner.base`,
re-exported here) and are loaded by name, so Megatron-Core is imported only when its backend is
built. Knows nothing of Ray, vLLM or the driver; the learner actor (:mod:`agentrl.actors.learner`)
runs it.
"""

from agentrl.learner.base import LEARNERS, Learner, build_learner, learner_traits, register_learner

__all__ = ["LEARNERS", "Learner", "build_learner", "learner_traits", "register_learner"]
