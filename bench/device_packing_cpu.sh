#!/usr/bin/env bash
# bench/packing.py on the device machine's CPU, pinned to 2 cores like the CPU dev machines
# (the GPU is not used). The device machine has torch and transformers but not this repo's
# venv; agentrl's packing and hf_forward need nothing else.
#
# Usage, from the repository root on the device machine:
#     bash bench/device_packing_cpu.sh [extra bench/packing.py flags]
# Writes $OUT/packing_cpu.log and $OUT/cpu.txt ($OUT defaults to /tmp/agentrl_packing).
set -euo pipefail
OUT=${OUT:-/tmp/agentrl_packing}
mkdir -p "$OUT"
{
    lscpu | grep -E "Model name|^CPU\(s\)"
    uptime
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} | tee "$OUT/cpu.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=2
taskset -c 0,1 python3 bench/packing.py "$@" 2>&1 | tee "$OUT/packing_cpu.log"
