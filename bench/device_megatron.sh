#!/usr/bin/env bash
# Megatron learner on the device machine. Usage (from the repo root, with .whl carried):
#   bash bench/device_megatron.sh check   # GPU tests (1 GPU: HF parity, train step, save/load; Qwen2, Qwen3, Llama)
#   bash bench/device_megatron.sh bench   # bench/learner.py (Megatron vs torch backend)
#   bash bench/device_megatron.sh tp2     # TP=2 vs TP=1 logprobs (2 GPUs)
#   bash bench/device_megatron.sh cp2     # bench/megatron_cp.py: CP=2 (2 GPUs) vs CP=1 (1 GPU) at 16k tokens,
#                                         # train_step loss/grad norm, tok/s/GPU, peak memory; CP=1 at 4k alongside
#   bash bench/device_megatron.sh cpflex  # bench/megatron_cp.py, Qwen2.5-1.5B shape, attention=flex, 2 GPUs, 32768 tokens
#                                         # per step in micro-batches of 16384: CP=1 with 4k documents (GPU 1) and CP=1 with
#                                         # 16k documents (GPU 0) side by side, then CP=1's out-of-memory probe (GPU 0), then
#                                         # CP=2 with 16k documents and CP=2 at the length CP=1 could not hold
#   bash bench/device_megatron.sh cpflex1 # the one-GPU part of cpflex: CP=1 16k docs + out-of-memory probe, CP=1 4k docs,
#                                         # then bench/cp.py --emulate-cp 2 (CP=2 attention per rank vs CP=1, flex vs SDPA mask)
#   bash bench/device_megatron.sh matrix4 # bench/megatron_cp.py on 4 GPUs at 16k tokens: TP1·CP1 (1 GPU), then TP2·CP2,
#                                         # then PP2·CP2 (last: likeliest to fail); one JSON each as it finishes
# Steps can be combined: bash bench/device_megatron.sh check bench
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, megatron.core as m; print('torch', torch.__version__, 'transformers', transformers.__version__, 'mcore', m.__version__)"
git rev-parse --short HEAD 2>/dev/null
rc=0
for step in "$@"; do
  case $step in
    check) python3 -m pytest -q -x -p no:cacheprovider tests/test_megatron_gpu.py -k "hf" -rA 2>&1 | tee "$OUT/check.log" || rc=1
           find /tmp/pytest-of-*/ -name 'hf_*.json' -exec cp {} "$OUT/" \; 2>/dev/null ;;
    bench) python3 -m torch.distributed.run --standalone --nproc-per-node 1 bench/learner.py --out "$OUT/bench.json" --profile "$OUT/profile.txt" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || rc=1 ;;
    tp2)   python3 -m pytest -q -x -p no:cacheprovider tests/test_megatron_gpu.py -k "tensor_parallel" -rA 2>&1 | tee "$OUT/tp2.log" || rc=1 ;;
    cp2)   W=/tmp/mcp; ONE="RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1"
           python3 bench/megatron_cp.py --make-model --workdir $W 2>&1 | tee "$OUT/cp2.log" || rc=1
           # CP=1 at 4k on GPU 1 while CP=1 at 16k runs on GPU 0 (one process each), then CP=2 on both.
           env $ONE MASTER_PORT=29612 CUDA_VISIBLE_DEVICES=1 timeout 180 python3 bench/megatron_cp.py --cp 1 \
               --tokens 4096 --workdir $W --out "$OUT/cp1_4k.json" > "$OUT/cp1_4k.log" 2>&1 &
           env $ONE MASTER_PORT=29611 CUDA_VISIBLE_DEVICES=0 timeout 180 python3 bench/megatron_cp.py --cp 1 \
               --workdir $W --out "$OUT/cp1.json" 2>&1 | tee -a "$OUT/cp2.log" || rc=1
           wait; echo "--- cp1 4k:"; grep -v Warning "$OUT/cp1_4k.log" | tail -n 15
           timeout 230 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/megatron_cp.py --cp 2 \
               --ref "$OUT/cp1.json" --workdir $W --out "$OUT/cp2.json" 2>&1 | tee -a "$OUT/cp2.log" || rc=1 ;;
    cpflex) L="$OUT/cpflex.log"; ONE="RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1"
           M="bench/megatron_cp.py --shape qwen1.5b --random-init --attention flex --tokens 32768 --mb-tokens 16384 --steps 4 --workdir /tmp/mcpf ${CPFLEX_ARGS:-}"
           echo "=== $(date +%T) CP=1 4k docs (GPU 1) | CP=1 16k docs + OOM probe (GPU 0)" | tee "$L"
           env $ONE MASTER_PORT=29612 CUDA_VISIBLE_DEVICES=1 timeout ${T1:-200} python3 $M --cp 1 --doc-len 4096 \
               --out "$OUT/cp1_d4096.json" > "$OUT/cp1_d4096.log" 2>&1 &
           env $ONE MASTER_PORT=29611 CUDA_VISIBLE_DEVICES=0 timeout ${T2:-250} python3 $M --cp 1 --doc-len 16384 --probe-auto \
               --out "$OUT/cp1_d16384.json" 2>&1 | grep -v Warning | tee -a "$L" || rc=1
           wait; echo "--- $(date +%T) CP=1 4k docs:" | tee -a "$L"; grep -v Warning "$OUT/cp1_d4096.log" | tail -n 12 | tee -a "$L"
           N=$(python3 -c "import json; d=json.load(open('$OUT/cp1_d16384.json')); print(d.get('oom_tokens') or max([e['tokens'] for e in d['phases'].get('probe', [])] or [65536]))" || echo 65536)
           echo "=== $(date +%T) CP=2 16k docs, then CP=2 at $N tokens" | tee -a "$L"
           timeout ${T3:-280} python3 -m torch.distributed.run --standalone --nproc-per-node 2 $M --cp 2 --doc-len 16384 \
               --ref "$OUT/cp1_d16384.json" --ref-tag cp1_d16384 --probe-tokens "$N" --out "$OUT/cp2_d16384.json" 2>&1 \
               | grep -v Warning | tee -a "$L" || rc=1 ;;
    cpflex1) L="$OUT/cpflex1.log"; ONE="RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29611"
           M="bench/megatron_cp.py --shape qwen1.5b --random-init --attention flex --tokens 32768 --mb-tokens 16384 --steps 4 --workdir /tmp/mcpf ${CPFLEX_ARGS:-}"
           echo "=== $(date +%T) CP=1 16k docs + out-of-memory probe" | tee "$L"
           env $ONE timeout ${T1:-240} python3 $M --cp 1 --doc-len 16384 --probe-auto --out "$OUT/cp1_d16384.json" 2>&1 \
               | grep -v Warning | tee -a "$L" || rc=1
           echo "=== $(date +%T) CP=1 4k docs" | tee -a "$L"
           env $ONE timeout ${T2:-150} python3 $M --cp 1 --doc-len 4096 --out "$OUT/cp1_d4096.json" 2>&1 \
               | grep -v Warning | tee -a "$L" || rc=1
           echo "=== $(date +%T) CP=2 attention emulated on one GPU" | tee -a "$L"
           timeout ${T3:-170} python3 bench/cp.py --emulate-cp 2 --emulate-tokens 16384,65536 --iters 10 \
               --json "$OUT/cp_emulated.json" 2>&1 | grep -v Warning | tee -a "$L" || rc=1 ;;
    matrix4) W=/tmp/mcp; L="$OUT/matrix4.log"; M="bench/megatron_cp.py --workdir $W --steps 2 --attention sdpa"
           python3 bench/megatron_cp.py --make-model --workdir $W 2>&1 | tee "$L" || rc=1
           env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 CUDA_VISIBLE_DEVICES=0 \
               timeout 90 python3 $M --cp 1 --out "$OUT/tp1cp1.json" 2>&1 | grep -v Warning | tee -a "$L" || rc=1
           for lay in "2 1" "1 2"; do set -- $lay; echo "=== $(date +%T) TP$1 PP$2 CP2" | tee -a "$L"
             timeout 110 python3 -m torch.distributed.run --standalone --nproc-per-node 4 $M --tp $1 --pp $2 --cp 2 \
               --ref "$OUT/tp1cp1.json" --ref-tag cp1 --out "$OUT/tp$1pp$2cp2.json" 2>&1 | grep -v Warning | tee -a "$L" || rc=1
           done ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
