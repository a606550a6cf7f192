# Sourced by the bench/device_*.sh and bench/peers/device.sh scripts on the GPU machine, from the repo
# root: `source bench/device_env.sh NAME`. It stops the caller (exit 3) when the carried vLLM is missing
# (the three carry calls of the vLLM 0.26.0 and Ray 2.60.0 wheels, built in .carry/c1-c3 for a GPU image without them, come first), makes envs/ and actors/ importable
# as agentrl.envs / agentrl.actors from the source tree (an installed package gets them from setuptools'
# package-dir), exports the environment that worked on the lent H100 (flashinfer's sampler off: it is not
# carried; no usage stats; no NVLink multicast), makes $OUT and prints the GPU.
_name=${1:-device}
_site=${DEVICE_SITE:-/tmp/site}  # where the carry calls unpacked vLLM and Ray
[ -d "$_site/vllm" ] || { echo "$_name: $_site/vllm is missing: run the three carry calls first"; exit 3; }
[ -e agentrl/envs ] || ln -s ../envs agentrl/envs
[ -e agentrl/actors ] || ln -s ../actors agentrl/actors
export PYTHONPATH=$PWD:$_site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
unset _name _site
