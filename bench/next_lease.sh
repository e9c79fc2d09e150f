#!/usr/bin/env bash
# Issue 12's next lease (bench/RESULTS.md, "Issue 12, nineteenth round"): one device call a part,
# after staging, each well under the 600 s limit; run the parts in this order on one machine.
# Results collect under /tmp/res/r19/PART on the machine; each call returns its part's files as
# $OUT/r19_PART.tgz, the FlashInfer JIT cache as $OUT/flashinfer_cache.tgz, and prints the
# batch-1 table of every part so far (bench.b1_report). Usage: bench/next_lease.sh PART
#   kernels  the few-row kernels' tiles and K splits in a chain (gemv-tiles: bf16, then FP8),
#            then decode attention alone: FlashInfer, XQA and the split-KV kernel (~5 min)
#   b1-bf16  batch-1 bf16 decode: defaults, the split-KV kernel, gate/up on cuBLAS, both; then
#            the GPU tests of the kernels built since the last lease (~7 min)
#   b1-fp8   batch-1 decode, fp8 weights + fp8 KV: defaults, split-K, the split-KV kernel, the
#            one-row FP8 GEMVs, all three (~5 min)
#   check    every GPU test (bench/gpu_session.sh check, ~8 min)
# A setting that wins becomes the default (the decode kernel at the batch sizes where it wins);
# one that loses is removed.
set -uo pipefail
part=${1:?part: kernels, b1-bf16, b1-fp8 or check}
final=${OUT:?set OUT}
res=/tmp/res/r19/$part
mkdir -p "$res"
session() { OUT=$res bash bench/gpu_session.sh "$@"; }
case $part in
  kernels)
    session gemv-tiles
    timeout 150 python3 -m bench.attention_bench --shapes 1x512 4x1500 64x1500 384x1500 \
      --json "$res/attention.json" > "$res/attention.txt" 2>&1
    echo "attention_bench rc=$?"
    tail -n 40 "$res/attention.txt"
    ;;
  b1-bf16)
    B1_ROWS=bf16 B1_VARIANTS="- KVRELAY_DECODE_KERNEL=triton KVRELAY_GATE_UP_BLAS=1 \
      KVRELAY_GATE_UP_BLAS=1,KVRELAY_DECODE_KERNEL=triton" session b1-variants
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_split_kv_decode_cuda.py \
      tests/gpu/test_fp8_dot_rows.py tests/gpu/test_fused_gemv_cuda.py tests/unit/test_split_k.py \
      tests/unit/test_split_kv_decode.py > "$res/tests_new_kernels.txt" 2>&1
    echo "new kernels' tests rc=$?" | tee -a "$res/tests_new_kernels.txt"
    tail -n 15 "$res/tests_new_kernels.txt"
    ;;
  b1-fp8)
    B1_ROWS=fp8w B1_VARIANTS="- KVRELAY_FP8_SPLIT_K=1 KVRELAY_DECODE_KERNEL=triton \
      KVRELAY_FP8_ONE_ROW=1 KVRELAY_FP8_ONE_ROW=1,KVRELAY_FP8_SPLIT_K=1,KVRELAY_DECODE_KERNEL=triton" \
      session b1-variants
    ;;
  check) session check ;;
  *) echo "unknown part $part (kernels, b1-bf16, b1-fp8 or check)" >&2; exit 2 ;;
esac
python3 -m bench.b1_report /tmp/res/r19/* 2>&1 | tail -n 60
tar czf "$final/flashinfer_cache.tgz" -C ~/.cache flashinfer 2>/dev/null
rm -f "$res/flashinfer_cache.tgz"
tar czf "$final/r19_$part.tgz" -C /tmp/res/r19 "$part"
ls -l "$final"
