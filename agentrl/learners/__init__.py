"""Learner backends behind one contract (:mod:`agentrl.learners.base`)."""

from agentrl.learners.base import LEARNERS, Learner, build_learner, learner_traits, register_learner

__all__ = ["LEARNERS", "Learner", "build_learner", "learner_traits", "register_learner"]
