.PHONY: setup quickstart test test-all test-fast docs docs-serve

setup:
	@bash scripts/setup_venv.sh

# The main job: tiny model -> SFT warm start -> async GRPO with a vLLM engine -> held-out eval.
quickstart: setup
	.venv/bin/agentrl train configs/quickstart.yaml

# The default tier: every path end to end once (train, resume, engine death, endpoint, LoRA, long
# context, chaos, distillation, sandbox, docs); tests marked `full` repeat a path and wait for test-all.
test: setup
	.venv/bin/python -m pytest -q -m "not full" --durations=15

# The whole suite, the `full` tier included.
test-all: setup
	.venv/bin/python -m pytest -q --durations=15

# Everything but the Ray/vLLM end-to-end runs.
test-fast: setup
	.venv/bin/python -m pytest -q -m "not slow"

# The docs site (docs/, mkdocs.yml) into site/; --strict: a broken link or reference fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict

# Serve the docs at http://127.0.0.1:8000, rebuilding on every change.
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs serve --dev-addr 127.0.0.1:8000
