#!/usr/bin/env bash
# The GPU pipeline on the device machine. First the three-call carry of vLLM, Ray and the
# project's extra wheels into /tmp/site (vLLM 0.26.0 and Ray 2.60.0 wheels, built in .carry/c1-c3 for a GPU image without them); then, from the repo root:
#   bash bench/device_e2e.sh tests   # tests/test_gpu_e2e.py: CUDA-IPC refit, sleep/wake memory,
#                                    # colocated engine + Megatron learner logprob agreement
#   bash bench/device_e2e.sh train   # agentrl train configs/gpu_1x.yaml (TRAIN_ARGS: extra overrides)
#   bash bench/device_e2e.sh bench   # bench/gpu_e2e.py (BENCH_ARGS: its options)
#   bash bench/device_e2e.sh profile # tools/learner_step.py: one learner step's wall vs GPU time (PROFILE_ARGS)
# Steps can be combined: bash bench/device_e2e.sh tests train. Everything lands in $OUT.
set -o pipefail
source bench/device_env.sh device_e2e  # carry check, import links, environment, $OUT, the GPU
python3 -c "import torch, vllm, ray, megatron.core as m; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'mcore', m.__version__)"
rc=0
for step in "$@"; do
  case $step in
    tests) AGENTRL_GPU_REPORT="$OUT/gpu_e2e_tests.json" python3 -m pytest -q -x -s -p no:cacheprovider \
             tests/test_gpu_e2e.py -rA 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/tests.log" || rc=1 ;;
    train) ( time python3 -c "import sys; from agentrl.cli import main; sys.exit(main())" train configs/gpu_1x.yaml \
             --no-progress ${TRAIN_ARGS:-} ) 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/train.log" || rc=1
           run_dir=$(python3 -c "from agentrl.config import load_config; import sys; print(load_config('configs/gpu_1x.yaml', sys.argv[1:]).run_dir)" ${TRAIN_ARGS:-})
           cp "$run_dir/summary.json" "$OUT/train_summary.json" 2>/dev/null
           cp "$run_dir/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null ;;
    bench) python3 bench/gpu_e2e.py --out "$OUT/gpu_e2e.json" ${BENCH_ARGS:-} 2>&1 | grep -v "Warning\|warn(" \
             | tee "$OUT/bench.log" || rc=1 ;;
    profile) python3 -m torch.distributed.run --nproc-per-node 1 tools/learner_step.py --out "$OUT/learner_step.json" \
             ${PROFILE_ARGS:-} 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/profile.log" || rc=1 ;;
    *) echo "device_e2e: unknown step '$step' (tests | train | bench | profile)"; rc=2 ;;
  esac
done
exit $rc
