#!/usr/bin/env bash
# Issue 52, first item: served goodput on one GPU, kvrelay's one-GPU deployment beside vLLM
# 0.26's OpenAI server with its defaults, the same serve_bench client over HTTP for both, one
# WORKLOAD (default long-prompt: 3,000 random tokens in, 150 out; Poisson arrivals) at each of
# RATES, SLO TTFT <= 1.5 s and TPOT <= 50 ms. Runs on the GPU machine after staging
# (bench/lease_stage.sh, or ../shared/device/stage.sh + ../shared/device/vllm/stage.sh), with the
# stage's exports set.
# Results go under $OUT/sg/ (JSON, tables, server logs); pack them with `bench/served_goodput.sh
# pack` (a call returns at most 8 files).
#   kvrelay  kvrelay's one-GPU deployment, the pools sized by memory (--gpu-memory-utilization
#            GPU_UTIL, default 0.9), once per config in CONFIGS (default "agg eager8k"):
#              agg       the default one-GPU setup: `kvrelay serve --prefill 0 --decode 1`, one
#                        aggregated decode worker computing every prompt beside its decodes on
#                        the whole card (its KV pool from all of GPU_UTIL, no idle prefill
#                        worker), 8,192-token prompt chunks (vLLM's default step budget here)
#              aggslo    agg with the bench's SLO as the router's objectives (--slo-ttft-ms 1500
#                        --slo-tpot-ms 50, overload queue): past saturation a request no worker
#                        is predicted to serve in time waits in the router, then gets 503
#              agg2k     the same with 2,048-token chunks
#              aggfp8kv  agg with an fp8 KV cache (vLLM's side: VLLM_ARGS="--kv-cache-dtype fp8")
#              aggfp8    agg with fp8 weights and KV (VLLM_ARGS="--quantization fp8 --kv-cache-dtype fp8")
#            and the setup before aggregated workers, for comparison: `--prefill 1 --decode 1
#            --gpus-per-worker 0.5`, the decode worker computing every prompt
#            (--local-prefill-max-tokens 1000000) while the prefill worker idles on half the
#            card's memory:
#              eager     2,048-token prompt chunks (issue 14's aggregated setup)
#              eager4k, eager8k  4,096- or 8,192-token chunks (eager8k: the best served config
#                        on 2026-12-06, before agg)
#            A config is skipped when fewer than MIN_LEFT_S (240) seconds are left before
#            DEADLINE (epoch seconds; default: none).
#   vllm     vLLM's server on the same model folder (bench/vllm_serve_peer.sh), the same load
#   offline  kvrelay's engine offline (bench.gpu_engine_bench) on the same workload, all at
#            once, with the served decode worker's step budget (128 + 2,048) and KV pool (read
#            from the last kvrelay server log; OFFLINE_KV_GIB overrides): what the served path
#            costs over its own engine, and batch-1 decode. OFFLINE_FLAGS: more flags
#   pack     $OUT/sg -> $OUT/served_goodput.tgz, the FlashInfer JIT cache -> $OUT
# WORKLOAD: one or several ("long-prompt sharegpt": each in turn; vLLM's server started once)
# of long-prompt (the default), sharegpt (ShareGPT-like lognormal lengths, prompts up to
# 2,048 tokens and outputs up to 1,024; its files are named *_sharegpt) or multi-turn (chat:
# CONVERSATIONS, default 48, of 4 turns, a 1,000-token first prompt then 100 new user tokens a
# turn, 150 out, each turn resending the history: 1,000 -> ~1,750-token prompts; RATES are
# conversations started per second; files *_multiturn). Over HTTP each turn's output comes back
# as text, and serve_bench re-tokenizes it with the folder's tokenizer for the next prompt, the
# same way for both servers (bench/lib/serve_workload.py text_encoder says why that is fair).
# RATES (default "4 8 12 16"), REQUESTS (default 120 a rate), SEQS (kvrelay's batch limit:
# default 128; auto: the engine's own choice). serve_bench seeds each rate's run
# by the rate's value (arrivals and prompts), so runs at one rate compare across RATES lists.
set -uo pipefail
part=${1:?part: kvrelay, vllm, offline or pack}
out=${OUT:?set OUT}/sg
mkdir -p "$out"
rates=${RATES:-4 8 12 16}
folder=/tmp/kvrelay-goodput-llama-3.1-8b  # the 8B shape, SmolLM2's tokenizer, no weights
requests=(--num-requests "${REQUESTS:-120}")
workload_args() {  # WORKLOAD: sets load (serve_bench's load flags) and tag (the file suffix)
  load=(--warmup 2 --slo-ttft-ms 1500 --slo-tpot-ms 50 --max-duration 150)
  case $1 in
    long-prompt) load+=("${requests[@]}" --input-len 3000 --output-len 150); tag="" ;;
    sharegpt) load+=("${requests[@]}" --workload sharegpt --max-input-len 2048 --max-output-len 1024)
      tag=_sharegpt ;;
    multi-turn) load+=(--workload multi-turn --num-conversations "${CONVERSATIONS:-48}" --turns 4
      --input-len 1000 --turn-input-len 100 --output-len 150 --tokenizer "$folder/tokenizer.json")
      tag=_multiturn ;;
    *) echo "unknown WORKLOAD $1 (long-prompt, sharegpt or multi-turn)" >&2; return 2 ;;
  esac
}
workloads=${WORKLOAD:-long-prompt}
for w in $workloads; do workload_args "$w" || exit 2; done
test -f "$folder/config.json" || python3 -c "from bench.lib.served_shape import \
write_served_shape; from pathlib import Path; write_served_shape(Path('$folder'), \
'llama-3.1-8b', print, Path('.cache/smollm2-tokenizer'))"
left() { if [ -n "${DEADLINE:-}" ]; then echo $((DEADLINE - $(date +%s))); else echo 99999; fi; }
shared="--gpus-per-worker 0.5 --local-prefill-max-tokens 1000000"  # 1 prefill + 1 decode, one card
config_flags() {  # CONFIG: its `kvrelay serve` flags beyond the common ones
  case $1 in
    agg) echo "--local-prefill-chunk-tokens 8192" ;;
    aggslo) echo "--local-prefill-chunk-tokens 8192 --slo-ttft-ms 1500 --slo-tpot-ms 50" ;;
    agg2k) echo "--local-prefill-chunk-tokens 2048" ;;
    aggfp8kv) echo "--local-prefill-chunk-tokens 8192 --kv-cache-dtype fp8" ;;
    aggfp8) echo "--local-prefill-chunk-tokens 8192 --quantization fp8 --kv-cache-dtype fp8" ;;
    eager) echo "$shared --local-prefill-chunk-tokens 2048" ;;
    eager4k) echo "$shared --local-prefill-chunk-tokens 4096" ;;
    eager8k) echo "$shared --local-prefill-chunk-tokens 8192" ;;
    *) echo "unknown config $1" >&2; return 2 ;;
  esac
}
seqs_flag() {  # SEQS: the worker's batch limit (default 128, every row so far; auto: the
  # engine's own, from its pool: up to 1,024, as vLLM's server takes 1,024 on an 80 GB card)
  case ${SEQS:-128} in auto) echo "" ;; *) echo "--max-num-seqs ${SEQS:-128}" ;; esac
}
seqs_tag=""; [ "${SEQS:-128}" != 128 ] && seqs_tag="_seqs${SEQS}"  # kept apart in the file names
config_prefill() {  # CONFIG: its prefill workers (0: aggregated)
  case $1 in agg*) echo 0 ;; *) echo 1 ;; esac
}
case $part in
  kvrelay)
    for w in $workloads; do
    workload_args "$w"
    for config in ${CONFIGS:-agg eager8k}; do
      flags=$(config_flags "$config") || continue
      if [ "$(left)" -lt "${MIN_LEFT_S:-240}" ]; then echo "kvrelay $config: skipped, $(left) s left"; continue; fi
      started=$(date +%s)
      # shellcheck disable=SC2086,SC2206  # rates and flags: several words
      timeout -k 20 $(( $(left) < 560 ? $(left) - 10 : 550 )) python3 -m bench.serve_bench \
        --launch --transport http --prefill "$(config_prefill "$config")" --decode 1 \
        --worker-niceness 0 \
        --startup-timeout 300 --rate $rates "${load[@]}" --label "kvrelay $config${tag}${seqs_tag}" \
        --server-args "--model $folder --load-format dummy --device cuda \
--gpu-memory-utilization ${GPU_UTIL:-0.9} $(seqs_flag) --max-model-len 4096 $flags" \
        --json "$out/kvrelay_$config$tag$seqs_tag.json" > "$out/kvrelay_$config$tag$seqs_tag.txt" \
        2> "$out/kvrelay_$config$tag$seqs_tag.err"
      echo "kvrelay $config$tag$seqs_tag rc=$? in $(( $(date +%s) - started )) s"
      log=$(ls -t /tmp/serve_bench_server_*.log 2>/dev/null | head -1)
      [ -n "$log" ] && mv "$log" "$out/kvrelay_$config$tag$seqs_tag.server.log"
      # the Triton variants a served step met first (engine/execution/kernel_compiles.py)
      grep -h "KV pool\|ready in\|kernel variant\|slow step" "$out/kvrelay_$config$tag$seqs_tag.server.log" "$out/kvrelay_$config$tag$seqs_tag.err" 2>/dev/null | cut -c1-300 | head -30
    done
    done
    ;;
  vllm)
    # one server start for every workload of WORKLOAD: the runs after the first follow --then
    runs=(); first=""
    for w in $workloads; do
      workload_args "$w"
      if [ -z "$first" ]; then first="$out/vllm$tag"; else runs+=(--then "$out/vllm$tag"); fi
      # shellcheck disable=SC2206  # the rates: several words
      runs+=(--rate $rates "${load[@]}")
    done
    timeout -k 20 $(( $(left) < 570 ? $(left) - 10 : 560 )) bench/vllm_serve_peer.sh "$folder" \
      "$first" "${runs[@]}"
    grep -h "KV cache\|max_num_batched_tokens\|max_num_seqs" "$first.server.log" | cut -c1-300 | head -8
    ;;
  offline)
    kv=${OFFLINE_KV_GIB:-$(grep -ho "KV pool [0-9.]* GiB" "$(ls -t "$out"/kvrelay_*.server.log | head -1)" \
      | awk '{print $3}' | sort -n | head -1)}
    echo "offline: KV pool ${kv:?no pool size found} GiB"
    # shellcheck disable=SC2086  # OFFLINE_FLAGS: several words
    timeout -k 10 $(( $(left) < 300 ? $(left) - 10 : 290 )) python3 -m bench.gpu_engine_bench \
      --num-requests "${OFFLINE_REQUESTS:-240}" \
      --input-len 3000 --output-len 150 --max-num-seqs 128 --max-num-batched-tokens 2176 \
      --kv-gib "$kv" --time-budget 200 --skip mixed ${OFFLINE_FLAGS:-} \
      --json "$out/offline_3000_150.json" \
      > "$out/offline_3000_150.txt" 2> "$out/offline_3000_150.err"
    echo "offline rc=$?"
    tail -n 6 "$out/offline_3000_150.txt" "$out/offline_3000_150.err"
    ;;
  pack)
    tar czf "$OUT/served_goodput.tgz" -C "$OUT" sg && rm -rf "$out"
    tar czf "$OUT/flashinfer_cache.tgz" -C ~/.cache flashinfer 2>/dev/null || true
    ls -l "$OUT"
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
for f in "$out"/*.txt; do [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }; done 2>/dev/null | tail -n 150
