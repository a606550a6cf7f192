#!/usr/bin/env bash
# Context-parallel attention on 2 GPUs (the `nvidia-h200-x2` device kind): CP=2 over NCCL vs.
# CP=1 at 16k tokens in bf16 -- agreement of outputs and q/k/v gradients with a float32
# reference, and attention forward+backward time per GPU. Needs only torch (no megatron-core).
#
# Usage, from the repository root on the device machine:
#     bash bench/device_cp.sh [extra bench/cp.py flags]
# Writes $OUT/cp.json, $OUT/cp.log and $OUT/gpus.txt ($OUT defaults to /tmp/agentrl_cp).
set -euo pipefail
OUT=${OUT:-/tmp/agentrl_cp}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpus.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" \
    bench/cp.py --json "$OUT/cp.json" "$@" 2>&1 | tee "$OUT/cp.log"
