#!/usr/bin/env bash
# LoRA on the GPU machine: bench/lora.py in two calls of < 9 min. First the three-call
# carry of vLLM and Ray into /tmp/site (vLLM 0.26.0 and Ray 2.60.0 wheels, built in .carry/c1-c3 for a GPU image without them); the third call also
# carries .peers/lora (the PEFT wheel: python3 -m pip download peft==0.21.2 --no-deps -d .peers/lora)
# and runs the first half. From the repo root:
#   bash bench/device_lora.sh install a   # carry [".carry/c3", ".peers/lora"], after the c3 install:
#                                         # PEFT into /tmp/site; refit seconds/MB at 1.5B and 7B
#                                         # (full vs adapter), the largest shape that trains, and
#                                         # engine-vs-learner logprobs with an adapter at 1.5B
#   bash bench/device_lora.sh b           # trajectories/s of the GPU loop with the torch learner at
#                                         # 1.5B: full fine-tuning, LoRA served merged, LoRA served
#                                         # as an adapter (in that order; the JSON is rewritten
#                                         # after each), then each LoRA mode / full
#   bash bench/device_lora.sh b7          # the same at the Qwen2.5-7B shape (GRPO on one GPU,
#                                         # random weights; full fine-tuning may OOM: that is data)
# The device commands for the serve=merged comparison, after the three carry calls (the
# third with carry [".carry/c3", ".peers/lora"] and `install` in front), each its own run call
# with timeout_s 600 on the same warm machine:
#   bash bench/device_lora.sh b           # 60 s windows, the three learners in one call
#   bash bench/device_lora.sh b7
# RESULTS' earlier 1.5B figures used 120 s windows, one learner per call:
#   B_ARGS="--learners torch_lora_merged --e2e-seconds 120" bash bench/device_lora.sh b
# The same with the engine awake beside the learner (it generates while the learner trains, the GPU
# loop's headline placement; the engine's share 0.2 as bench/gpu_e2e.py's split default):
#   B_ARGS="--learners torch_lora_merged,torch_full --e2e-seconds 90 --e2e-placement split --engine-mem 0.2" bash bench/device_lora.sh b
#   bash bench/device_lora.sh ls          # one learner step at 1.5B, profiled: full fine-tuning, LoRA
#                                         # fused with autograd's backward, LoRA fused forward and backward
#                                         # (tools/learner_step.py; ~4 min a variant: LS_VARIANTS picks;
#                                         # LS_ARGS="--steps 3 --profile-steps 1": two variants in ~4.5 min)
#   bash bench/device_lora.sh check       # the torch learner's GPU tests (the sync-free micro-batch, the fused AdamW step, the
#                                         # fused head, a train step on the GPU vs the CPU): run first
#   bash bench/device_lora.sh tests       # the CPU LoRA tests on the GPU's engine (optional)
# Everything lands in $OUT (lora_a.json, lora_b.json, logs). A_ARGS / B_ARGS: extra bench options.
set -o pipefail
source bench/device_env.sh device_lora  # carry check, import links, environment, $OUT, the GPU
rc=0
for step in "$@"; do
  case $step in
    install)
      # The device image has peft 0.21.0 (its pip freeze); the carried wheel
      # pins the version the CPU tests ran (0.21.2) and wins on PYTHONPATH.
      if ls .peers/lora/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .peers/lora/*.whl 2>&1 | tail -2
      else
        echo "device_lora: no .peers/lora wheel carried: using the image's peft"
      fi
      python3 -c "import torch, vllm, peft; print('torch', torch.__version__, 'vllm', vllm.__version__, 'peft', peft.__version__)" || rc=1 ;;
    a) timeout -k 20 "${A_TIMEOUT:-500}" python3 bench/lora.py --parts refit,fit,agreement --out "$OUT/lora_a.json" ${A_ARGS:-} 2>&1 \
         | grep -v "Warning\|warn(\|it/s\]" | tee "$OUT/lora_a.log" || rc=1 ;;
    b) timeout -k 20 "${B_TIMEOUT:-570}" python3 bench/lora.py --parts e2e --out "$OUT/lora_b.json" \
         --learners torch_full,torch_lora_merged,torch_lora ${B_ARGS:-} 2>&1 \
         | grep -v "Warning\|warn(\|it/s\]" | tee "$OUT/lora_b.log" || rc=1 ;;
    b7) timeout -k 20 "${B7_TIMEOUT:-570}" python3 bench/lora.py --parts e2e --e2e-shape 7b --out "$OUT/lora_b7.json" \
         --learners torch_full,torch_lora_merged,torch_lora ${B_ARGS:-} 2>&1 \
         | grep -v "Warning\|warn(\|it/s\]" | tee "$OUT/lora_b7.log" || rc=1 ;;
    ls) timeout -k 20 "${LS_TIMEOUT:-500}" python3 tools/learner_step.py --variants "${LS_VARIANTS:-torch_full,torch_lora_autograd,torch_lora}" \
         --workdir /tmp/learner_step --out "$OUT/learner_step_lora.json" ${LS_ARGS:-} 2>&1 \
         | grep -v "Warning\|warn(\|it/s\]" | tee "$OUT/learner_step_lora.log" || rc=1 ;;
    check) timeout -k 20 "${C_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_torch_learner.py tests/test_optim.py \
         tests/test_hf_forward.py tests/test_packing.py 2>&1 | grep -v "Warning\|warn(" | tee "$OUT/lora_check.log" || rc=1 ;;
    tests) timeout -k 20 "${T_TIMEOUT:-400}" python3 -m pytest -q -x -s -p no:cacheprovider tests/test_lora.py 2>&1 \
         | grep -v "Warning\|warn(" | tee "$OUT/lora_tests.log" || rc=1 ;;
    *) echo "device_lora: unknown step '$step' (install | a | b | b7 | ls | check | tests)"; rc=2 ;;
  esac
  # anything a killed run left on the GPU would skew the next part (bracketed: never this script)
  for pat in '[E]ngineCore' '[r]ay::' '[r]aylet' '[g]cs_server'; do pkill -9 -f "$pat" 2>/dev/null; done
done
exit $rc
