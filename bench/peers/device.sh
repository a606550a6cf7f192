#!/usr/bin/env bash
# The peer harness on the GPU machine (bench/peers/README.md). First the three-call carry of vLLM and
# Ray into /tmp/site (vLLM 0.26.0 and Ray 2.60.0 wheels, built in .carry/c1-c3 for a GPU image without them); then, from the repo root, steps in any order:
#   bash bench/peers/device.sh trl-install                # the call that carries .peers/trl
#   bash bench/peers/device.sh verl-install verl:multi:recommended   # the call that carries .peers/verl
#   bash bench/peers/device.sh agentrl:multi:recommended,like trl:multi:recommended
# Each run step is SYSTEM:WORKLOAD:SETTINGS[:gGpP][wWsS][:latS] (gGpP: G samples of P prompts a step instead
# of the workload's, e.g. trl:long96k:recommended:g4p1; wWsS: W warm-up and S timed steps, e.g.
# agentrl:long128k:recommended:g4p1w1s5 or trl:multi:like:w2s4; latS: each tool call sleeps S s, e.g.
# agentrl:multi:like:lat0; all after PEER_ARGS, so they win); results are appended to $OUT/peers.json,
# logs to $OUT/SYSTEM-WORKLOAD[-latS].log (-2, -3, ... for a step repeated in one queue).
# A repeated pair as one queue, interleaved so that drift on the machine hits both systems alike:
#   bash bench/peers/device.sh trl-install bg agentrl:multi:like:lat0 trl:multi:like:lat0 agentrl:multi:like:lat0 trl:multi:like:lat0 ...
# RUN_TIMEOUT (s, default 540) bounds each run step; PEER_ARGS are passed to every runner.
# A run longer than one call (verl single-turn: ~20 min) starts detached and is waited for by later calls:
#   bash bench/peers/device.sh verl-install start:verl:single:recommended wait   # then, each within 30 s:
#   bash bench/peers/device.sh wait                                               # until it prints "done"
# `start:` runs the runner in a session of its own (setsid: it outlives the call, /tmp/peers/bg) with
# BG_TIMEOUT (s, default 1440) for the whole run; `wait` waits WAIT_S (default 550) or until it ends,
# copies its log and result to $OUT and exits 0 once it ended, 4 while it still runs (call `wait` again).
# Run no other step while a detached run is on the GPU (a run step ends by killing Ray and vLLM leftovers).
#   bash bench/peers/device.sh fit:agentrl:recommended:16,24,32,48   # where a system stops fitting:
# longNk for each N in turn (1 warm-up + 1 timed step each, PEER_ARGS after), until a run is not "ok";
# lengths given longest first (fit:trl:recommended:64,48,32) probe down instead, until a run is "ok"
# (an OOM comes early in a run, a fit costs whole steps: the cheaper order where most lengths fail).
# FIT_PROBE=1 makes each a probe: one step of 4 episodes (1 prompt x 4 samples, no warm-up; results
# named longNk-g4p1), the same memory per micro-batch as the full workload's 16 (common.run_workload)
# at a quarter of a step: TRL's long48k did not finish a step of 16 in 270 s on the H200. FIT_GROUP=2
# halves a probe's step again (2 episodes, named longNk-g2p1): TRL takes ~300 s for 4 episodes of 192k.
# A fresh machine's first run also makes the harness model (minutes): give it RUN_TIMEOUT >= 540.
# `bg`: the steps after it run detached, one after another, in a device.sh of their own (setsid: it
# outlives the call; its $OUT is /tmp/peers/q/out), each run bounded by RUN_TIMEOUT as in the foreground,
# so the GPU keeps working between calls and no run is cut by a call's 600 s:
#   RUN_TIMEOUT=900 FIT_PROBE=1 bash bench/peers/device.sh trl-install bg fit:trl:recommended:96,64 fit:agentrl:recommended:128,96
#   bash bench/peers/device.sh wait     # each within 30 s of the last call, until it prints "done"
# `wait` copies the queue's logs and peers.json to $OUT and prints what it printed since the last `wait`;
# `stop` ends a detached queue or run (its processes and any Ray and vLLM leftovers).
# GPU=N (a host of several GPUs): this call's steps and its queue use GPU N alone (CUDA_VISIBLE_DEVICES),
# so two queues run side by side, one a GPU, e.g. on nvidia-h200-x2:
#   GPU=0 bash bench/peers/device.sh bg trl:long256k:sleep:g2p1w1s3; GPU=1 bash bench/peers/device.sh bg agentrl:long256k:recommended:g2p1w1s5
#   bash bench/peers/device.sh wait     # waits for every queue; their logs come back as gpuN-SYSTEM-WORKLOAD.log
# A GPU's queue ends only the Ray and vLLM processes its own runs started (they inherit PEERS_TAG=gpuN);
# the two runs share the host's cores and memory (each result's extra.gpu says which GPU of how many).
# Two runs on Ray (agentrl, verl) side by side are untried on a GPU host (two local Ray clusters ran side
# by side on the CPU machine, each on its own random ports, their processes tagged): give the second its
# own --workdir in PEER_ARGS (run directories are named by workload and setting), or queue both on one GPU.
# `tests:FILE[,FILE...]` runs pytest on them (TESTS_TIMEOUT s, default 300) into $OUT/tests.log.
# `attention` runs bench/attention.py (ATT_LENGTHS, default 32768,65536,131072; ATT_TIMEOUT s, default 300; ATT_ARGS)
# into $OUT/attention.json: FlexAttention vs SDPA's kernels on one long document, the learner's choice.
set -o pipefail
source bench/device_env.sh peers  # carry check, import links, environment, $OUT, the GPU
rc=0
own_args=()
runners=${PEERS_RUNNERS:-bench/peers}  # where run_<system>.py live (tests put stand-ins here)
bg=${PEERS_BG_DIR:-/tmp/peers/bg}     # one detached run (start:)
qbase=${PEERS_QUEUE_DIR:-/tmp/peers/q}  # a detached queue of steps (bg); one a GPU with GPU=N: $qbase-gpuN
gpu=${GPU:-}
[[ -z $gpu || $gpu =~ ^[0-9]+$ ]] || { echo "peers: GPU='$gpu' is not a GPU's index"; exit 2; }
if [ -n "$gpu" ]; then
  export CUDA_VISIBLE_DEVICES=$gpu PEERS_TAG=gpu$gpu  # the runs' processes inherit the tag (kill_leftovers)
  q=$qbase-gpu$gpu
else
  q=$qbase
fi
steps=(); queued=(); to_bg=0          # the steps before `bg` run here, those after it detached
for a in "$@"; do
  if [ $to_bg = 1 ]; then queued+=("$a"); elif [ "$a" = bg ]; then to_bg=1; else steps+=("$a"); fi
done
what_runs() { cat "$1/step" 2>/dev/null || cat "$1/steps"; }  # a detached run's step or a queue's steps
running() { [ -f "$1/pid" ] && kill -0 "$(cat "$1/pid")" 2>/dev/null; }
queues() {  # the queues this call may touch: its GPU's and the all-GPU one, or, without GPU, every one
  local d
  for d in "$qbase" "$qbase"-gpu*; do
    [ -d "$d" ] || continue
    [ -z "$gpu" ] || [ "$d" = "$qbase" ] || [ "$d" = "$q" ] && echo "$d"
  done
}
detached_running() {  # prints what a detached run or queue this call may touch still runs; false when none does
  local d
  for d in "$bg" $(queues); do running "$d" && { what_runs "$d"; return 0; }; done
  return 1
}
tree() { local c; echo "$1"; for c in $(pgrep -P "$1"); do tree "$c"; done; }  # a process and its descendants
tagged() { tr '\0' '\n' < "/proc/$1/environ" 2>/dev/null | grep -qx "PEERS_TAG=$PEERS_TAG"; }
kill_leftovers() {
  [ "${PEERS_KILL_LEFTOVERS:-1}" = 1 ] || return 0
  local pat pid
  for pat in '[E]ngineCore' '[r]ay::' '[r]aylet' '[g]cs_server'; do
    if [ -n "${PEERS_TAG:-}" ]; then  # one GPU's queue: what its own runs started, not the other GPU's
      for pid in $(pgrep -f "$pat"); do tagged "$pid" && kill -9 "$pid" 2>/dev/null; done
    else
      pkill -9 -f "$pat" 2>/dev/null
    fi
  done
}

run_step() {  # SYSTEM WORKLOAD SETTINGS [runner args PEER_ARGS override]: one run step; returns the runner's status
  # the array own_args, if set, goes after PEER_ARGS (a step's own batch, steps and tool latency win)
  # its log: $OUT/SYSTEM-WORKLOAD[-latS].log, -2, -3, ... for the repeats of a queue (none overwrites another)
  local system=$1 workload=$2 settings=$3 site=$PYTHONPATH src n=1 base; shift 3
  [ "$system" = trl ] && site=/tmp/peer-trl:$PYTHONPATH
  [ "$system" = verl ] && site=/tmp/peer-verl:$PYTHONPATH
  base="$OUT/${system}-${workload}${LOG_TAG:-}"; last_log="$base.log"
  while [ -e "$last_log" ]; do n=$((n + 1)); last_log="$base-$n.log"; done
  echo "== $system:$workload:$settings${LOG_TAG:-} ($(date +%T))"
  PYTHONPATH=$site timeout -k 20 "${RUN_TIMEOUT:-540}" python3 "$runners/run_$system.py" --workload "$workload" \
    --settings "${settings:-recommended}" --out "$OUT/peers.json" --workdir /tmp/peers "$@" ${PEER_ARGS:-} "${own_args[@]}" 2>&1 \
    | grep -v "Warning\|warn(\|it/s\]" > "$last_log"; src=$?
  grep "^RESULT" "$last_log" | cut -c1-400
  [ $src = 0 ] || { echo "$system:$workload:$settings exited $src"; tail -30 "$last_log"; }
  # anything a killed run left on the GPU would skew the next one (bracketed patterns: pkill -f must
  # not match this script's own command line). PEERS_KILL_LEFTOVERS=0 leaves them (tests: the machine's
  # other Ray processes, e.g. the test session's own cluster, whose raylet's death ends its driver)
  kill_leftovers
  sleep "${SETTLE_S:-3}"
  return $src
}
for step in "${steps[@]}"; do
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
      # SYSTEM:WORKLOAD:SETTINGS[:gGpP][wWsS][:latS]: a batch, warm-up and timed steps, tool latency of its own
      IFS=: read -r system workload settings rest <<< "$step"
      own=(); tag=""; bad=""
      IFS=: read -r -a parts <<< "$rest"
      for part in "${parts[@]}"; do
        if [[ $part =~ ^(g([0-9]+)p([0-9]+))?(w([0-9]+)s([0-9]+))?$ && -n $part ]]; then
          [ -n "${BASH_REMATCH[1]}" ] && own+=(--group-size "${BASH_REMATCH[2]}" --prompts-per-step "${BASH_REMATCH[3]}")
          [ -n "${BASH_REMATCH[4]}" ] && own+=(--warmup "${BASH_REMATCH[5]}" --steps "${BASH_REMATCH[6]}")
        elif [[ $part =~ ^lat([0-9]*\.?[0-9]+)$ ]]; then
          own+=(--tool-latency "${BASH_REMATCH[1]}"); tag="-lat${BASH_REMATCH[1]}"
        else bad=$part; fi
      done
      if [ -n "$bad" ]; then
        echo "peers: '$bad' in '$step' is not a batch, steps or tool latency (gGpP: G samples of P prompts a step; wWsS: W warm-up and S timed steps; latS: S seconds a tool call)"; rc=2
      else  # the step's own arguments come after PEER_ARGS: they win (argparse keeps the last)
        own_args=("${own[@]}"); LOG_TAG=$tag run_step "$system" "$workload" "$settings" || rc=1; own_args=()
      fi ;;
    fit:*)
      IFS=: read -r _ system settings lengths <<< "$step"
      read -r -a ns <<< "${lengths//,/ }"
      down=0; [ "${#ns[@]}" -gt 1 ] && [ "${ns[0]}" -gt "${ns[1]}" ] && down=1  # longest first: probe down
      probe=""; [ "${FIT_PROBE:-0}" = 1 ] && probe="--warmup 0 --group-size ${FIT_GROUP:-4} --prompts-per-step 1"
      for n in "${ns[@]}"; do
        run_step "$system" "long${n}k" "$settings" --warmup 1 --steps 1 $probe
        last=$(grep "^RESULT" "$last_log" | tail -1)
        if [[ $last == *'"status": "ok"'* ]]; then
          echo "fit: $system ($settings) fits long${n}k"
          [ $down = 1 ] && break
        else
          echo "fit: $system ($settings) does not fit long${n}k: $(grep -o '"status": "[a-z]*"' <<< "$last" || echo 'no result')"
          [ $down = 0 ] && break
        fi
      done ;;
    start:*)
      IFS=: read -r _ system workload settings <<< "$step"
      mkdir -p $bg
      if on=$(detached_running); then echo "peers: a detached run is on: $on"; exit 2; fi
      rm -f $bg/peers.json $q/pid; echo "$system:$workload:${settings:-recommended}" > $bg/step
      site=$PYTHONPATH; [ "$system" = trl ] && site=/tmp/peer-trl:$PYTHONPATH
      [ "$system" = verl ] && site=/tmp/peer-verl:$PYTHONPATH
      extra=""; [ "$system" = verl ] && extra="--timeout ${BG_TIMEOUT:-1440}"
      echo "== start $step ($(date +%T)), detached"
      rm -f $bg/pid  # the runner's own pid, written by the shell that becomes it (setsid may fork)
      PYTHONPATH=$site setsid nohup bash -c 'echo $$ > '$bg'/pid; exec python3 "$@"' _ "bench/peers/run_$system.py" \
        --workload "$workload" --settings "${settings:-recommended}" --out $bg/peers.json --workdir /tmp/peers \
        $extra ${PEER_ARGS:-} > $bg/run.log 2>&1 < /dev/null &
      for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s $bg/pid ] && break; sleep 0.5; done
      [ -s $bg/pid ] || { echo "peers: the detached run did not start"; exit 1; } ;;
    wait)
      waited=(); for d in $(queues); do [ -f "$d/pid" ] && waited+=("$d"); done
      if [ ${#waited[@]} -gt 0 ]; then  # queues (bg): wait for all, then hand over what they wrote so far
        t0=$SECONDS
        while [ $((SECONDS - t0)) -lt "${WAIT_S:-550}" ]; do
          on=0; for d in "${waited[@]}"; do running "$d" && on=1; done
          [ $on = 1 ] || break; sleep 5
        done
        jsons=()
        for d in "${waited[@]}"; do
          name=${d##*/}; pre=""; tag=""
          [ "$d" = "$qbase" ] || { pre="${name##*-}-"; tag="[${name##*-}] "; }  # gpuN- before a GPU queue's files
          for f in "$d/out/"*; do
            [ -e "$f" ] || continue
            if [ "${f##*/}" = peers.json ]; then jsons+=("$f"); else cp -r "$f" "$OUT/$pre${f##*/}"; fi
          done
          shown=$(cat "$d/shown" 2>/dev/null || echo 0)
          tail -n +$((shown + 1)) "$d/run.log" | grep "^== \|^RESULT\|^fit: \|^peers: \|exited\| passed\| failed" \
            | cut -c1-400 | sed "s/^/$tag/"
          wc -l < "$d/run.log" > "$d/shown"
          if running "$d"; then
            echo "${tag}peers: the queue still runs ($(grep '^== ' "$d/run.log" | tail -1)) after $((SECONDS - t0)) s of this call: call 'wait' again within 30 s"; rc=4
          else
            echo "${tag}peers: the queue is done: $(cat "$d/steps")"
          fi
        done
        # every queue's results in one peers.json (the table below reads it)
        [ ${#jsons[@]} -gt 0 ] && python3 -c 'import json, sys
rows = []
for f in sys.argv[2:]:
    try:
        rows += json.load(open(f))
    except (OSError, ValueError) as e:  # a queue of an older harness that wrote it in place, say
        print(f"peers: {f} not read ({e}): call wait again")
json.dump(rows, open(sys.argv[1], "w"), indent=2)' "$OUT/peers.json" "${jsons[@]}"
        continue
      fi
      [ -f $bg/pid ] || { echo "peers: no detached run (start:SYSTEM:WORKLOAD:SETTING or bg first)"; exit 2; }
      pid=$(cat $bg/pid); t0=$SECONDS
      while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "${WAIT_S:-550}" ]; do sleep 5; done
      name=$(tr : - < $bg/step)
      grep -v "Warning\|warn(\|it/s\]" $bg/run.log > "$OUT/$name.log"
      # verl's per-step line, shortened: step, its time and parts, the batch reward
      grep -o "step:[0-9]* \|timing_s/\(step\|gen\|old_log_prob\|update_actor\):[0-9.]*\|critic/score/mean:[0-9.]*" \
        $bg/run.log | paste -sd' ' | sed 's/ step:/\nstep:/g' 
      if kill -0 "$pid" 2>/dev/null; then
        echo "peers: $(cat $bg/step) still running after $((SECONDS - t0)) s of this call: call 'wait' again within 30 s"; rc=4
      else
        echo "peers: $(cat $bg/step) done"; [ -f $bg/peers.json ] && cp $bg/peers.json "$OUT/peers.json"
        grep "^RESULT" $bg/run.log | cut -c1-400
        kill_leftovers
      fi ;;
    attention)  # the learner's core attention, FlexAttention vs SDPA's kernels at long lengths (bench/attention.py)
      echo "== attention ($(date +%T))"
      timeout -k 10 "${ATT_TIMEOUT:-300}" python3 bench/attention.py --lengths "${ATT_LENGTHS:-32768,65536,131072}" \
        --json "$OUT/attention.json" ${ATT_ARGS:-} > "$OUT/attention.log" 2>&1 || { echo "attention exited $?"; rc=1; }
      grep -v "Warning\|warn(" "$OUT/attention.log" | tail -40 ;;
    tests:*)  # tests:tests/a.py,tests/b.py::case: pytest on this GPU (between runs, in a queue too)
      files=${step#tests:}; echo "== tests ${files//,/ } ($(date +%T))"
      timeout -k 10 "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rfE ${files//,/ } \
        > "$OUT/tests.log" 2>&1 || { echo "tests exited $?"; rc=1; }
      tail -5 "$OUT/tests.log" ;;
    stop)
      for d in "$bg" $(queues); do
        if running "$d"; then
          # the whole tree, not the process group: `timeout` puts each run in a group of its own
          kill -9 $(tree "$(cat "$d/pid")") 2>/dev/null; echo "peers: stopped $(what_runs "$d")"
        fi
      done
      kill_leftovers ;;
    *) echo "peers: unknown step '$step'"; rc=2 ;;
  esac
done
if [ $to_bg = 1 ]; then
  if on=$(detached_running); then echo "peers: a detached run is on: $on"; exit 2; fi
  [ ${#queued[@]} -gt 0 ] || { echo "peers: nothing after bg"; exit 2; }
  # a finished queue of the other kind (all GPUs / one GPU) would be waited for and merged again: gone
  if [ -n "$gpu" ]; then rm -rf "$qbase"; else rm -rf "$qbase"-gpu*; fi
  rm -rf "$q"; mkdir -p "$q/out"; rm -f "$bg/pid"; echo "${queued[*]}" > "$q/steps"
  echo "== bg ($(date +%T))${gpu:+ on GPU $gpu}, detached: ${queued[*]}"
  # the queue's shell writes its own pid (setsid may fork); `stop` ends it and everything under it
  OUT=$q/out setsid nohup bash -c 'echo $$ > "$0/pid"; exec bash bench/peers/device.sh "$@"' "$q" "${queued[@]}" \
    > "$q/run.log" 2>&1 < /dev/null &
  for _ in 1 2 3 4 5 6 7 8 9 10; do [ -s "$q/pid" ] && break; sleep 0.5; done
  [ -s "$q/pid" ] || { echo "peers: the queue did not start"; exit 1; }
fi
python3 bench/peers/table.py "$OUT/peers.json" 2>/dev/null || true
exit $rc
