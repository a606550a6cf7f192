import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 model made on the spot (agentrl bootstrap-tiny), shared by the session."""
    from agentrl.model.tiny import bootstrap_tiny

    return str(bootstrap_tiny(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_family_dir(tmp_path_factory):
    """``tiny_family_dir(family)``: a tiny model of that family (agentrl bootstrap-tiny --family),
    made once per session."""
    from agentrl.model.tiny import bootstrap_tiny

    made = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = str(bootstrap_tiny(tmp_path_factory.mktemp(f"tiny-{family}") / "model", family=family))
        return made[family]

    return get


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    """One vLLM engine of the tiny model (CPU, max_model_len 1024) on an event loop in a thread of
    its own, shared by the session's tests that sample and score with a plain engine (a vLLM start
    takes tens of seconds on 2 cores): ``(engine, server)``; ``server.run(coro)`` runs a coroutine
    on the engine's loop. A test that loads other weights into it loads the base ones back."""
    import asyncio

    from agentrl.config import EngineConfig
    from agentrl.engine.vllm_engine import VLLMEngine
    from tests.endpoint_helpers import ServerThread

    server = ServerThread()
    engine = VLLMEngine(tiny_model_dir, EngineConfig(max_model_len=1024))
    server.run(engine.start(), timeout=300)
    yield engine, server
    # The engine's client holds zmq sockets: left to the garbage collector, its context's term()
    # blocks whichever later test happens to collect it (the whole suite then hangs).
    server.loop.call_soon_threadsafe(engine.shutdown)
    server.run(asyncio.sleep(0.5))
    server.close()


@pytest.fixture(scope="module")
def ray_local_2cpu():
    """A local Ray of 2 CPUs for the module (started here unless one runs already)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def isolated_registries(monkeypatch):
    """User modules (``my_*``, ``user_*``, ``examples.*``) are imported afresh by each test; what they
    register in the loss, estimator and backend registries or add to sys.path goes away after it."""
    import sys

    from agentrl.config.registry import ADVANTAGE_ESTIMATORS, LEARNERS, LOSSES

    registries = (LOSSES, ADVANTAGE_ESTIMATORS, LEARNERS)
    monkeypatch.setattr(sys, "path", list(sys.path))
    modules, entries = set(sys.modules), [dict(r._entries) for r in registries]
    yield
    for name in set(sys.modules) - modules:
        if name.startswith(("my_", "user_", "examples")):
            del sys.modules[name]
    for registry, saved in zip(registries, entries):
        registry._entries.clear()
        registry._entries.update(saved)
