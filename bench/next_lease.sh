#!/usr/bin/env bash
# Issue 12's next lease (bench/RESULTS.md, "Issue 12, nineteenth round"): one device call a part,
# after staging, each well under the 600 s limit, on one machine, in the order below (the
# decisive runs first: staging and the four parts come to about the session's 30 minutes).
# Results collect under /tmp/res/r19/PART on the machine; each call returns its part's files as
# $OUT/r19_PART.tgz, the FlashInfer JIT cache as $OUT/flashinfer_cache.tgz, and prints the
# batch-1 table of every part so far (bench.b1_report); a part still running at PART_S seconds
# (540, check 560) is cut, and what it wrote comes back all the same. Usage: bench/next_lease.sh PART
#   b1-bf16  batch-1 bf16 decode: defaults, the split-KV kernel, gate/up on cuBLAS, both (~4 min;
#            a fresh machine's first run compiles)
#   b1-fp8   batch-1 decode, fp8 weights + fp8 KV: defaults, split-K, the split-KV kernel, the
#            one-row FP8 GEMVs, all three (~5 min)
#   check    every GPU test (bench/gpu_session.sh check, ~8 min; the new kernels' among them)
#   kernels  the few-row kernels' tiles and K splits in a chain (gemv-tiles: bf16, then FP8),
#            then decode attention alone: FlashInfer, XQA and the split-KV kernel (~5 min)
# Staging first: ../shared/device/stage.sh grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0
# xgrammar, then bench/gpu_stage_extras.sh (its header says how the .cache/gguf pieces ride
# along with the stage calls); the parts' calls carry .cache/gguf/6, .cache/smollm2-tokenizer and
# .flashinfer-cache (the JIT cache of the last lease, as flashinfer_cache.tgz).
# A setting that wins becomes the default (the decode kernel at the batch sizes where it wins);
# one that loses is removed.
set -uo pipefail
part=${1:?part: b1-bf16, b1-fp8, check or kernels}
final=${OUT:?set OUT}
case $part in b1-bf16 | b1-fp8 | check | kernels) ;;
  *) echo "unknown part $part (b1-bf16, b1-fp8, check or kernels)" >&2; exit 2 ;; esac
res=/tmp/res/r19/$part
mkdir -p "$res"
if [ -z "${NEXT_LEASE_CHILD:-}" ]; then  # measure in a child cut at PART_S, then always report
  limit=${PART_S:-$([ "$part" = check ] && echo 560 || echo 540)}
  NEXT_LEASE_CHILD=1 timeout "$limit" bash "$0" "$part"
  echo "$part rc=$? (124: cut at $limit s)"
  python3 -m bench.b1_report /tmp/res/r19/* 2>&1 | tail -n 60
  if [ -d ~/.cache/flashinfer ]; then tar czf "$final/flashinfer_cache.tgz" -C ~/.cache flashinfer; fi
  rm -f "$res/flashinfer_cache.tgz"
  tar czf "$final/r19_$part.tgz" -C /tmp/res/r19 "$part"
  ls -l "$final"
  exit 0
fi
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
    ;;
  b1-fp8)
    B1_ROWS=fp8w B1_VARIANTS="- KVRELAY_FP8_SPLIT_K=1 KVRELAY_DECODE_KERNEL=triton \
      KVRELAY_FP8_ONE_ROW=1 KVRELAY_FP8_ONE_ROW=1,KVRELAY_FP8_SPLIT_K=1,KVRELAY_DECODE_KERNEL=triton" \
      session b1-variants
    ;;
  check) session check ;;
esac
