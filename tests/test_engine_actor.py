"""The vLLM engine actor: in-flight refit (continue / drain) with per-token versions, and a
restart that loads the current weights before taking work."""

import time

import pytest
import torch

pytestmark = pytest.mark.slow


def hf_logprobs(model, ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [0.0] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.fixture(scope="module")
def actors(tiny_model_dir):
    import ray

    from agentrl.actors.engine import EngineActor
    from agentrl.actors.weights import WeightStoreActor
    from agentrl.config import EngineConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    store = WeightStoreActor.remote()
    engine = EngineActor.options(num_cpus=1, max_restarts=-1, max_task_retries=0).remote(
        tiny_model_dir, EngineConfig(max_model_len=2048), weight_source=store)
    ray.get(engine.start.remote())
    yield ray, engine, store
    ray.shutdown()


def perturbed(tiny_model_dir, seed):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_continue_mode_tags_tokens_with_the_version_that_made_them(actors, tiny_model_dir):
    ray, engine, store = actors
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    new = perturbed(tiny_model_dir, 1)
    prompt = list(range(5, 25))
    ref = engine.generate.remote(prompt, 1500, 1.0, 1.0, None, True)
    time.sleep(1.0)
    ray.get(engine.update_weights.remote(new.state_dict(), 1, "continue"))
    out = ray.get(ref)
    assert out.versions == sorted(out.versions), "versions must never go back within a turn"
    assert out.versions[0] == 0 and out.versions[-1] == 1, "the refit did not land mid-request"
    switch = out.versions.index(1)
    ids = prompt + out.token_ids
    expect_old = hf_logprobs(old, ids)[len(prompt):len(prompt) + switch]
    diff = max(abs(a - b) for a, b in zip(expect_old, out.logprobs[:switch]))
    assert diff < 1e-4, f"tokens tagged version 0 were not sampled from the old weights ({diff:.2e})"
    assert ray.get(engine.version.remote()) == 1


def test_drain_mode_finishes_running_requests_on_old_weights(actors, tiny_model_dir):
    ray, engine, store = actors
    newer = perturbed(tiny_model_dir, 2)
    ref = engine.generate.remote(list(range(5, 25)), 400, 1.0, 1.0, None, True)
    time.sleep(0.3)
    ray.get(engine.update_weights.remote(newer.state_dict(), 2, "drain"))
    out = ray.get(ref)
    assert set(out.versions) == {1}
    assert ray.get(engine.version.remote()) == 2


def test_restarted_engine_loads_current_weights_before_work(actors, tiny_model_dir):
    ray, engine, store = actors
    current = perturbed(tiny_model_dir, 3)
    weights_ref = ray.put(current.state_dict())
    ray.get(engine.update_weights.remote(weights_ref, 3, "continue"))
    ray.get(store.stage_weights.remote(3, [weights_ref]))
    old_pid = ray.get(engine.pid.remote())
    ray.kill(engine, no_restart=False)
    ids = list(range(5, 60))
    deadline = time.time() + 300
    while True:
        try:
            served = ray.get(engine.score.remote(ids))
            break
        except ray.exceptions.RayActorError:
            if time.time() > deadline:
                raise
            time.sleep(1)
    assert ray.get(engine.pid.remote()) != old_pid, "the engine was not restarted"
    assert ray.get(engine.version.remote()) == 3
    diff = max(abs(a - b) for a, b in zip(hf_logprobs(current, ids)[1:], served[1:]))
    assert diff < 1e-4, f"the restarted engine does not serve the current weights ({diff:.2e})"
