#!/usr/bin/env bash
# The agent endpoint on the GPU machine: bench/agent_endpoint.py with a Qwen2.5-0.5B-shaped
# model with random weights (bf16, the tiny tokenizer, built on the spot on the GPU; nothing downloaded),
# where sampling costs what it does for users. Prints and writes to $OUT/device_endpoint.json:
#   - round trip: the same greedy 16-token request, direct engine call vs through the endpoint over HTTP
#     (raw httpx, openai SDK, ...): p50/p90 and the added ms; and the same against an instant engine;
#   - throughput at equal work: episodes of 4 requests x N tokens each (T 1.0), the env path (TurnsEnv)
#     vs the endpoint path (a plain openai-SDK agent), same messages by seed, alternating reps, at three
#     loads (64-256 concurrent episodes): trajectories/s, sampled tokens/s, endpoint / env; the endpoint path
#     once per AGENT_WORKERS value (default 0,8: the agents in the bench's process, then in 8 agent worker
#     processes, agent.workers=8), each against the env path, all alternating;
#   - engine vs torch-learner logprobs (Hugging Face forward, bf16) on both paths' trajectories: mean |delta|.
# First the three-call carry of vLLM and Ray into /tmp/site (vLLM 0.26.0 and Ray 2.60.0 wheels, built in .carry/c1-c3 for a GPU image without them); then,
# from the repo root, in the third call or a later one:
#   bash bench/device_endpoint.sh          # ~4-6 min on one H100 (vLLM compiled, CUDA graphs)
#   bash bench/device_endpoint.sh eager    # the same with enforce_eager (if the compiled start fails)
# ENDPOINT_ARGS: extra options for bench/agent_endpoint.py (e.g. "--shape 1.5b" or "--requests 50"; they come
# last, so they override the script's). AGENT_WORKERS: the agent.workers values to compare (e.g. 0,4,12).
# On a CPU, the same logic with a small stand-in shape (no GPU needed; what the CPU test ran):
#   python bench/agent_endpoint.py --shape cpu --requests 3 --warmup 1 --group-size 2 --turns 2 --max-tokens 8 --sweep 1x8,2x4
set -o pipefail
source bench/device_env.sh device_endpoint  # carry check, import links, environment, $OUT, the GPU
EXTRA=""; NAME=device_endpoint
[ "${1:-}" = eager ] && { EXTRA="--eager"; NAME=device_endpoint_eager; }
python3 -c "import torch, vllm, openai, httpx, uvicorn; print('torch', torch.__version__, 'vllm', vllm.__version__, 'openai', openai.__version__, 'httpx', httpx.__version__, 'uvicorn', uvicorn.__version__)"
# 100 round trips per row (7 rows x ~0.1 s each on a 0.5B model); throughput at three points, episodes of
# 4 requests, groups of 8, 4 reps alternating: 8 groups x 128 tokens (64 concurrent episodes, about a rollout
# worker of configs/gpu_1x.yaml), 16 x 64 (128) and 32 x 64 (256 concurrent episodes in one process).
# With three paths (env, endpoint, endpoint_w8) the throughput part takes ~1.5x what it did with two: if the
# run nears the limit, drop round trips (ENDPOINT_ARGS="--requests 40").
timeout -k 20 "${ENDPOINT_TIMEOUT:-550}" python3 bench/agent_endpoint.py --shape 0.5b --requests 100 \
    --group-size 8 --turns 4 --max-tokens 64 --sweep 8x128,16x64,32x64 --reps 4 --out "$OUT/$NAME.json" \
    --agent-workers "${AGENT_WORKERS:-0,8}" $EXTRA ${ENDPOINT_ARGS:-} 2>&1 \
  | grep -v "Warning\|warn(\|it/s\]" | tee "$OUT/$NAME.log"
rc=${PIPESTATUS[0]}
# anything a killed run left on the GPU (listed; vLLM's engine process ends with its parent)
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$OUT/leftover_gpu_processes.csv"
exit $rc
