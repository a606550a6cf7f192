"""Thin Ray actor shells around agentrl's core: engine, rollout, replay, learner, weight store."""

__all__: list[str] = []
