#!/usr/bin/env bash
# Where agentrl's GPU memory goes at TRL's memory settings, after the three-call carry:
# the GPU tests of the memory tools, then agentrl:multi:memory once per variant; each run's result
# (learner_memory_gib: allocator peaks by phase, `outside_*` = the driver's count for the learner's
# process beyond its allocator; engine_memory_gib; gpu_processes_gib) under $OUT/<run>/peers.json.
#   bash bench/peers/memory_probe.sh [solo] [copy] [expandable] [plain] [engine_expandable] [fp32_masters] [lazy] [eager] [shared] [netshared0] [object_store]
# (default: solo copy lazy). solo: the memory setting as it is (a one-rank learner without NCCL,
# agentrl/learner/megatron/solo.py; refit.zero_copy; learner.expandable_segments; the fp32 master
# weights as int16 remainders beside the bf16 weights, learner.megatron.master_weight_remainders); copy: the refit
# through a flat export buffer (refit.zero_copy=false); expandable: the same as solo (the setting
# has had expandable segments since 2026-11-28; before, solo had them off); plain: solo with
# learner.expandable_segments=false; engine_expandable: solo with vLLM's allocator in expandable
# segments too (engine.expandable_segments); fp32_masters: solo with fp32 master weights (no
# remainders: the setting before 2026-11-29); lazy / eager:
# the one-rank learner on NCCL (AGENTRL_ONE_RANK_NCCL=1), communicators made lazily / eagerly;
# shared: eager, split communicators sharing the parent's resources (NCCL_COMM_SPLIT_SHARE_RESOURCES);
# netshared0: lazy with NCCL_NET_SHARED_BUFFERS=0 (a one-rank communicator allocated a 512 MiB NET
# shared pool: NVIDIA/nccl issue 2363); object_store: the refit through Ray's object store.
# PROBE_ARGS go to every run (e.g. "--kv-blocks-from $OUT/peers.json" after TRL's run: an equal KV cache).
# PROBE_TESTS=0 skips the tests, PROBE_K picks some of them (pytest -k); RUN_TIMEOUT (s, default 360)
# bounds each run: the first run on a fresh machine makes the random 1.5B model too (~245-270 s in all
# on the H200; 175 and 270 s cut runs short).
set -o pipefail
source bench/device_env.sh memory_probe
root=$OUT
[ "${PROBE_TESTS:-1}" = 0 ] || python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_optim.py tests/test_torch_learner.py \
  tests/test_refit.py tests/test_megatron_logprobs.py tests/test_megatron_gpu.py \
  -k "${PROBE_K:-fused or peaks or plain or main_grad or zero_copy or remainders or recompute}" 2>&1 \
  | grep -v "Warn\|warn(\|DEBUG" | tail -4
for run in ${@:-solo copy lazy}; do
  args="--steps ${PROBE_STEPS:-3} ${PROBE_ARGS:-}"
  nccl="AGENTRL_ONE_RANK_NCCL=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT"  # the log names each communicator NCCL makes
  case $run in
    solo) env="VLLM_LOGGING_LEVEL=INFO" ;;  # vLLM's log gives its KV cache size
    copy) env=""; args="$args --set refit.zero_copy=false" ;;
    expandable) env=""; args="$args --set learner.expandable_segments=true" ;;
    plain) env=""; args="$args --set learner.expandable_segments=false" ;;
    engine_expandable) env="VLLM_LOGGING_LEVEL=INFO"; args="$args --set engine.expandable_segments=true" ;;
    fp32_masters) env="VLLM_LOGGING_LEVEL=INFO"; args="$args --set learner.megatron.master_weight_remainders=false" ;;
    lazy) env="$nccl" ;;
    eager) env="$nccl AGENTRL_NCCL_EAGER_INIT=1" ;;
    shared) env="$nccl AGENTRL_NCCL_EAGER_INIT=1 NCCL_COMM_SPLIT_SHARE_RESOURCES=1" ;;  # split communicators share the parent's
    netshared0) env="$nccl NCCL_NET_SHARED_BUFFERS=0" ;;  # no NET shared pool (NCCL issue 2363)
    object_store) env=""; args="$args --set refit.transport=object_store" ;;
    *) echo "memory_probe: unknown run '$run'"; exit 2 ;;
  esac
  env $env OUT=$root/$run RUN_TIMEOUT=${RUN_TIMEOUT:-360} PEER_ARGS="$args" bash bench/peers/device.sh agentrl:multi:memory \
    | grep "^RESULT\|exited" | cut -c1-300
  echo "$run: NCCL communicators made (lines 'Init COMPLETE' in the log): $(grep -c 'Init COMPLETE' "$root/$run/agentrl-multi.log" 2>/dev/null)"
  python3 - "$root/$run/peers.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))[-1]
print(sys.argv[1].split("/")[-2], "peak", round(r["peak_gpu_gib"], 2), "processes", r["extra"].get("gpu_processes_gib", {}).get("at_device_peak"))
print("  learner", r["extra"].get("learner_memory_gib"))
print("  engine", r["extra"].get("engine_memory_gib"))
PY
done
