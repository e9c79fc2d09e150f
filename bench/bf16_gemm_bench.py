"""bf16 GEMMs other than the engine's on the 8B projections at the offline rows' step sizes, each
timed as bench.fp8_gemv_bench times them (graph replays): the engine's `x @ W^T` (cuBLAS's
heuristic pick); the same with torch's preferred BLAS set to cuBLASLt; FlashInfer's mm_bf16 on
cuBLASLt at its heuristic pick and at the fastest of cuBLASLt's candidate algorithms
(FlashInfer's autotuner); with --extra, FlashInfer's cuDNN and cuTile backends (cuTile
autotunes per shape, minutes on a cold machine). The decode steps' GEMMs cost per row what a
batch of 512 rows does only at some row counts (bench/overlap_probe.py: 17.4 ms a step at 704
rows, 17.7 at 768, 10.5 at 512): is that the kernel choice? Prints per-step ms over the 32
layers and TFLOP/s per candidate, and each candidate's largest error against the float32
product; a candidate this install refuses is reported, not fatal. A graph replays one weight
20 times, so at few rows o_proj's and qkv's weights may stay in L2: compare candidates with one
another, not with the engine's step. Owns no state; needs a GPU.

    python -m bench.bf16_gemm_bench [--rows 16384 768 704 512 384 232] [--extra] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lib.gemm_timing import Candidates, print_step, time_candidates, tune_exact

TUNED = ("flashinfer cublaslt tuned", "flashinfer cutile tuned")
BF16_GEMM_OP = "bf16_gemm"  # mm_bf16's name in FlashInfer's autotuner


def candidates(x: torch.Tensor, weight: torch.Tensor, extra: bool) -> Candidates:
    """label -> (op computing x @ W^T in bf16, its float32 product), W the bf16 weight.
    FlashInfer's ops pick their tactic when called (at graph capture): the heuristic ones with
    the autotuner told to skip mm_bf16, the tuned ones from what tune_exact found for exactly
    this row count."""
    from flashinfer.autotuner import autotune

    weight = weight.bfloat16()
    want = x.float() @ weight.float().t()

    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16, device="cuda")
    w_t = weight.t()  # (K, N), column-major: what mm_bf16 takes

    def engine() -> torch.Tensor:
        return x @ w_t

    def torch_cublaslt() -> torch.Tensor:
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return x @ w_t
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    def flashinfer_backend(backend: str, tuned: bool) -> Callable[[], torch.Tensor]:
        def op() -> torch.Tensor:
            import flashinfer

            context = (
                autotune(False, tuning_buckets=(x.shape[0],))
                if tuned
                else autotune(False, skip_ops={BF16_GEMM_OP})
            )
            with context:
                return flashinfer.mm_bf16(x, w_t, out=out, backend=backend)

        return op

    ops = {
        "engine (cuBLAS)": engine,
        "torch on cuBLASLt": torch_cublaslt,
        "flashinfer cublaslt heuristic": flashinfer_backend("cublaslt", tuned=False),
        "flashinfer cublaslt tuned": flashinfer_backend("cublaslt", tuned=True),
    }
    if extra:
        ops["flashinfer cudnn"] = flashinfer_backend("cudnn", tuned=False)
        ops["flashinfer cutile tuned"] = flashinfer_backend("cutile", tuned=True)
    return {label: (op, want) for label, op in ops.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[16384, 768, 704, 512, 384, 232])
    p.add_argument("--extra", action="store_true", help="also FlashInfer's cuDNN and cuTile")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for num_rows in args.rows:
        row = time_candidates(
            num_rows, gen, lambda x, w: candidates(x, w, args.extra), TUNED, tune_exact
        )
        results.append(row)
        print_step(row)
        if args.json:  # after every row count: a run cut short keeps what it measured
            report = {"gpu": torch.cuda.get_device_name(), "rows": results}
            args.json.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
