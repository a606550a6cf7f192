.PHONY: setup quickstart test test-fast

setup:
	@bash scripts/setup_venv.sh

# The main job: tiny model -> SFT warm start -> async GRPO with a vLLM engine -> held-out eval.
quickstart: setup
	.venv/bin/agentrl train configs/quickstart.yaml

test: setup
	.venv/bin/python -m pytest -q

# Everything but the Ray/vLLM end-to-end runs.
test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow"
