#!/usr/bin/env bash
# The vLLM peer of a serving benchmark, on the GPU machine after both stages (kvrelay's in
# /tmp/site, vLLM's in /tmp/vsite; ../shared/device/README.md): starts vLLM's OpenAI server on
# MODEL_DIR with random weights (load_format dummy) and its own defaults, waits for it, runs
# bench.serve_bench against it over HTTP with the remaining arguments, and stops it.
#   bench/vllm_serve_peer.sh MODEL_DIR OUT_PREFIX [serve_bench args...] [--then PREFIX2 args2...]
# VLLM_ARGS: more server flags (e.g. --kv-cache-dtype fp8).
# Writes OUT_PREFIX.json (serve_bench's report), OUT_PREFIX.txt and OUT_PREFIX.server.log; each
# `--then PREFIX args` runs serve_bench again on the same server (one start for several loads).
# The server needs more than vLLM's offline stage: carry .cache/vllm-server-wheels
# (bench/gpu_stage_extras.sh), installed here into /tmp/vsite once.
set -uo pipefail
model=${1:?model folder}; prefix=${2:?output prefix}; shift 2
quoted() { [ $# -eq 0 ] || printf '%q ' "$@"; }  # an empty group stays empty, not ''
prefixes=("$prefix"); groups=(); cur=()
while [ $# -gt 0 ]; do
  if [ "$1" = --then ]; then
    groups+=("$(quoted "${cur[@]}")"); cur=(); prefixes+=("${2:?--then needs a prefix}"); shift 2
  else cur+=("$1"); shift; fi
done
groups+=("$(quoted "${cur[@]}")")
if [ -d .cache/vllm-server-wheels ] && [ ! -f /tmp/vsite/.server-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/vsite \
    .cache/vllm-server-wheels/*.whl 2>&1 | grep -v "already exists" || true
  touch /tmp/vsite/.server-wheels
fi
port=8100
# shellcheck disable=SC2086  # VLLM_ARGS: several words
PYTHONPATH=/tmp/vsite:/tmp/site HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  python3 -m vllm.entrypoints.openai.api_server --model "$model" --load-format dummy \
  --port "$port" --max-model-len 4096 ${VLLM_ARGS:-} > "$prefix.server.log" 2>&1 &
server=$!
started=$(date +%s)
until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/v1/models', timeout=2)" 2>/dev/null; do
  if ! kill -0 "$server" 2>/dev/null; then echo "vLLM server exited"; tail -20 "$prefix.server.log"; exit 1; fi
  if [ $(( $(date +%s) - started )) -gt 420 ]; then echo "vLLM server not up in 420 s"; kill "$server"; exit 1; fi
  sleep 2
done
echo "vLLM up in $(( $(date +%s) - started )) s"
rc=0
for i in "${!prefixes[@]}"; do
  eval "args=(${groups[$i]})"
  p=${prefixes[$i]}
  python3 -m bench.serve_bench --url "http://127.0.0.1:$port" --transport http --label vllm "${args[@]}" \
    --json "$p.json" > "$p.txt" 2> "$p.err"
  r=$?; [ $r -ne 0 ] && rc=$r
  echo "serve_bench $p rc=$r"
  tail -n 12 "$p.txt"
done
kill -INT "$server"; wait "$server"
exit $rc
