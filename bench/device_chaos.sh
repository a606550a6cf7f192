#!/usr/bin/env bash
# Faults on the GPU loop (issue 33), on one GPU, in this order: a refit that times out (the engine
# frozen while it loads weights), then the engine killed and restarted under colocation with sleep
# mode (the driver must load the current weights into the restarted engine: CUDA IPC stages none).
# The JSON is written after each phase and on SIGTERM; the script's own waits end by --budget-s
# (440 s), so the 540 s timeout below always leaves a JSON saying how far the run got.
# First the three-call carry of vLLM, Ray and the project's wheels into /tmp/site
# (../shared/device/vllm/README.md); then, from the repo root, in the third call or a later one:
#   bash bench/device_chaos.sh            # ~4-8 min on one H100; writes $OUT/device_chaos.json
# CHAOS_ARGS: extra options/overrides for bench/device_chaos.py (e.g. --steps 10).
set -o pipefail
[ -d /tmp/site/vllm ] || { echo "device_chaos: /tmp/site/vllm is missing: run the three carry calls first"; exit 3; }
[ -e agentrl/envs ] || ln -s ../envs agentrl/envs
[ -e agentrl/actors ] || ln -s ../actors agentrl/actors
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/tmp/site/bin:$PATH  # py-spy, for the stacks of the frozen engine
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 540 python3 bench/device_chaos.py --out "$OUT/device_chaos.json" ${CHAOS_ARGS:-} 2>&1 \
  | grep -v "Warning\|warn(" | tee "$OUT/device_chaos.log"
rc=${PIPESTATUS[0]}
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$OUT/leftover_gpu_processes.csv"
exit $rc
