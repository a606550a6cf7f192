"""Learner backends behind one contract (:mod:`agentrl.learner.base`)."""

from agentrl.learner.base import LEARNERS, Learner, build_learner

__all__ = ["LEARNERS", "Learner", "build_learner"]
