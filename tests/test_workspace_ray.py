"""A Ray actor that holds RepoFix episodes (as a rollout actor does) dies: its workspaces die with it."""

from __future__ import annotations

import os
import time

import pytest

from tests.proc_helpers import ns_members

pytestmark = pytest.mark.slow



def test_killed_actor_leaves_no_workspace_process():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0, max_restarts=0)
        class EpisodeHolder:
            def start(self, seeds: list[int]) -> list[str]:
                import agentrl.envs  # noqa: F401
                import gymnasium

                from agentrl.rollout.chat import format_tool_call

                self.envs = [gymnasium.make("agentrl/RepoFix-v0") for _ in seeds]
                namespaces = []
                for env, seed in zip(self.envs, seeds):
                    env.reset(seed=seed)
                    env.step(format_tool_call("bash", {"command": "setsid sleep 600 >/dev/null 2>&1 & sleep 0.2"}))
                    init = env.unwrapped.workspace.processes()[0]
                    namespaces.append(os.readlink(f"/proc/{init}/ns/pid"))
                return namespaces

        holder = EpisodeHolder.remote()
        namespaces = set(ray.get(holder.start.remote([0, 1, 2]), timeout=120))
        assert len(namespaces) == 3 and len(ns_members(namespaces)) >= 9  # init, shell, sleep each
        ray.kill(holder, no_restart=True)
        deadline = time.monotonic() + 30
        while ns_members(namespaces) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ns_members(namespaces) == []
    finally:
        ray.shutdown()
