"""Thin Ray actor shells around agentrl's core: engine, rollout, replay, learner."""

__all__: list[str] = []
