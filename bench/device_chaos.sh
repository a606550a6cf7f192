#!/usr/bin/env bash
# Faults on the GPU loop, on one GPU, in this order: a refit that times out (the engine
# frozen while it loads weights), then the engine killed and restarted under colocation with sleep
# mode (the driver must load the current weights into the restarted engine: CUDA IPC stages none).
# The JSON is written after each phase and on SIGTERM; the script's own waits end by --budget-s
# (440 s), so the 540 s timeout below always leaves a JSON saying how far the run got.
# First the three-call carry of vLLM, Ray and the project's wheels into /tmp/site
# (vLLM 0.26.0 and Ray 2.60.0 wheels, built in .carry/c1-c3 for a GPU image without them); then, from the repo root, in the third call or a later one:
#   bash bench/device_chaos.sh            # ~4-8 min on one H100; writes $OUT/device_chaos.json
# CHAOS_ARGS: extra options/overrides for bench/device_chaos.py (e.g. --steps 10).
set -o pipefail
source bench/device_env.sh device_chaos  # carry check, import links, environment, $OUT, the GPU
export PATH=/tmp/site/bin:$PATH  # py-spy, for the stacks of the frozen engine
timeout 540 python3 bench/device_chaos.py --out "$OUT/device_chaos.json" ${CHAOS_ARGS:-} 2>&1 \
  | grep -v "Warning\|warn(" | tee "$OUT/device_chaos.log"
rc=${PIPESTATUS[0]}
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$OUT/leftover_gpu_processes.csv"
exit $rc
