"""Learner backends behind one contract (:mod:`agentrl.learners.base`)."""

from agentrl.learners.base import LEARNERS, Learner, build_learner

__all__ = ["LEARNERS", "Learner", "build_learner"]
