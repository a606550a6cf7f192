#!/usr/bin/env bash
# The peer harness on the GPU machine (bench/peers/README.md). First the three-call carry of vLLM and
# Ray into /tmp/site (../shared/device/vllm/README.md); then, from the repo root, steps in any order:
#   bash bench/peers/device.sh trl-install                # the call that carries .peers/trl
#   bash bench/peers/device.sh verl-install verl:multi:recommended   # the call that carries .peers/verl
#   bash bench/peers/device.sh agentrl:multi:recommended,like trl:multi:recommended
# Each run step is SYSTEM:WORKLOAD:SETTINGS; results are appended to $OUT/peers.json, logs to $OUT.
# RUN_TIMEOUT (s, default 540) bounds each run step; PEER_ARGS are passed to every runner.
set -o pipefail
source bench/device_env.sh peers  # carry check, import links, environment, $OUT, the GPU
rc=0
for step in "$@"; do
  case $step in
    trl-install)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer-trl .peers/trl/*.whl || rc=1
      PYTHONPATH=/tmp/peer-trl:$PYTHONPATH python3 -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" || rc=1 ;;
    verl-install)
      # verl's own transformers 5.9.0 + tokenizers 0.22.2 go ahead of the image's 5.17.0 / 0.23.2
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer-verl .peers/verl/*.whl || rc=1
      PYTHONPATH=/tmp/peer-verl:$PYTHONPATH python3 -c "import verl, transformers, tokenizers, tensordict, transfer_queue, vllm
import verl.trainer.main_ppo, verl.workers.rollout.vllm_rollout.vllm_async_server, bench.peers.verl_plugin
print('verl', verl.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'vllm', vllm.__version__)" \
        || { echo "peers: verl does not import: no verl run in this call"; exit 1; } ;;
    agentrl:*|trl:*|verl:*)
      IFS=: read -r system workload settings <<< "$step"
      site=$PYTHONPATH; [ "$system" = trl ] && site=/tmp/peer-trl:$PYTHONPATH
      [ "$system" = verl ] && site=/tmp/peer-verl:$PYTHONPATH
      echo "== $step ($(date +%T))"
      PYTHONPATH=$site timeout -k 20 "${RUN_TIMEOUT:-540}" python3 "bench/peers/run_$system.py" --workload "$workload" \
        --settings "${settings:-recommended}" --out "$OUT/peers.json" --workdir /tmp/peers ${PEER_ARGS:-} 2>&1 \
        | grep -v "Warning\|warn(\|it/s\]" > "$OUT/${system}-${workload}.log"; src=$?
      grep "^RESULT" "$OUT/${system}-${workload}.log" | cut -c1-400
      [ $src = 0 ] || { echo "$step exited $src"; tail -30 "$OUT/${system}-${workload}.log"; rc=1; }
      # anything a killed run left on the GPU would skew the next one
      # (bracketed patterns: pkill -f must not match this script's own command line)
      for pat in '[E]ngineCore' '[r]ay::' '[r]aylet' '[g]cs_server'; do pkill -9 -f "$pat" 2>/dev/null; done; sleep 3 ;;
    *) echo "peers: unknown step '$step'"; rc=2 ;;
  esac
done
python3 bench/peers/table.py "$OUT/peers.json" 2>/dev/null || true
exit $rc
