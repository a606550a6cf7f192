"""Model families end to end: demonstrations in each family's format, and (slow) three learner
steps with refits on a tiny Llama 3 (the Qwen2 run is tests/test_pipeline_e2e.py's)."""

import pytest

from agentrl.config import load_config


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3", "mistral"])
def test_expert_demonstrations_call_the_tool_in_the_familys_format(family, tiny_family_dir):
    """The Calculator expert writes calls in the family's format; the env (reading them with the
    family's vLLM parser) answers with the result, which the delta renders in the family's role."""
    from transformers import AutoTokenizer

    from agentrl.rollout.chat import ChatRenderer
    from agentrl.envs.calculator import CalculatorEnv
    from agentrl.driver.sft import build_demonstrations
    from agentrl.rollout.tool_calls import build_tool_parser

    path = tiny_family_dir(family)
    tok = AutoTokenizer.from_pretrained(path)
    renderer, parser = ChatRenderer(tok), build_tool_parser("auto", path, tok)
    seed = 3
    (ids, mask), = build_demonstrations("agentrl/Calculator-v0", renderer, [seed], tool_parser=parser, guess_prob=0.0)
    env = CalculatorEnv()
    env.reset(seed=seed)
    text = tok.decode(ids)
    result = {"qwen2": f"<tool_response>\n{env.answer}\n</tool_response>", "qwen3": f"<tool_response>\n{env.answer}\n",
              "llama3": f"<|start_header_id|>ipython<|end_header_id|>\n\n{env.answer}<|eot_id|>",
              "mistral": f"[TOOL_RESULTS]{env.answer}[/TOOL_RESULTS]"}[family]
    assert result in text and "Error" not in text
    assert parser.format("calculate", {"expression": env.expression}) in text
    sampled = [i for i, m in zip(ids, mask) if m]
    assert sampled.count(renderer.end_of_turn_id) == 2  # the call turn and the answer turn


def test_model_family_key_bootstraps_that_family(tmp_path):
    from agentrl.config import ConfigError
    from agentrl.model.tiny import tiny_family
    from agentrl.model.loading import resolve_model_path

    cfg = load_config(None, [f"model.path={tmp_path / 'm'}", "model.bootstrap_tiny=true", "model.family=llama3"])
    path = resolve_model_path(cfg)
    assert tiny_family(path) == "llama3"
    with pytest.raises(ConfigError, match="model.family: 'mistral', but model.path .* holds a tiny 'llama3'"):
        resolve_model_path(load_config(None, [f"model.path={path}", "model.bootstrap_tiny=true",
                                              "model.family=mistral"]))
    with pytest.raises(Exception, match="model.family"):
        load_config(None, ["model.family=gemma"])


@pytest.mark.slow
@pytest.mark.full  # the train path on a second family; its chat format has unit tests
def test_llama3_trains_three_steps_with_refits(tiny_family_dir, tmp_path):
    """Three learner steps with a refit after each on a tiny Llama 3 (header tokens, <|eot_id|>
    ends turns while the tokenizer's EOS is <|end_of_text|>): engine and learner agree after refits."""
    from tests.test_pipeline_e2e import e2e_overrides, mean_abs_diff, read_rows, train_and_score

    r = train_and_score(load_config(None, e2e_overrides(tiny_family_dir("llama3"), tmp_path / "run")))
    assert r["version"] == 3 and r["engine_version"] == 3
    assert mean_abs_diff(r["before"], r["after"]) > 1e-3, "the refit changed nothing"
    agree = mean_abs_diff(r["learner"], r["after"])
    assert agree < 1e-3, f"engine and learner logprobs differ after refit (mean abs {agree:.2e})"
    steps = [r for r in read_rows(tmp_path / "run") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[-1]["replay/token_version_max"] >= 1, "no token was sampled with refit weights"
    # SayNumber ends an episode on a digit: turns ended at the end-of-turn token, or a digit was said
    assert all(0.0 <= r["rollout/reward"] <= 1.0 for r in steps)


def test_cli_bootstrap_tiny_family_and_eval_parser_check(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "bootstrap-tiny", str(tmp_path / "m"), "--family",
                          "mistral"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    from agentrl.rollout.tool_calls import detect_tool_parser

    assert detect_tool_parser(tmp_path / "m") == "mistral"
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "eval", "--model", str(tmp_path / "m"),
                          "--tool-parser", "hermess"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--tool-parser: unknown tool parser 'hermess'. Did you mean 'hermes'?" in out.stderr
