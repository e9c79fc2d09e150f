"""FP8 GEMM kernels other than the engine's on the 8B projections at the offline run's step
sizes (16,384, 768 and 232 rows), each timed as bench.fp8_gemv_bench times them (graph
replays): the engine's torch._scaled_mm with row-wise scales (cuBLASLt's heuristic pick);
the same with one scale per tensor; FlashInfer's cuBLASLt FP8 GEMM (one scale per tensor) at
its heuristic pick and at the fastest of cuBLASLt's candidate algorithms (FlashInfer's
autotuner, at exactly each row count since the eleventh round of bench/RESULTS.md: before,
its default buckets tuned 16,384 rows first and the smaller counts ran a tactic found for
another M, and the "heuristic" column after the first count may have used a tuned one);
FlashInfer's SM90 block-scaled GEMM (DeepGEMM: 1 x 128 input and weight scale
groups). Prints per-step ms over the 32 layers and TFLOP/s per candidate, and each
candidate's largest error against the float32 product of its own quantized operands; a
candidate this install refuses is reported, not fatal. Owns no state; needs a Hopper GPU.

    python -m bench.fp8_gemm_bench [--rows 16384 768 232] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from bench.lib.gemm_timing import print_step, time_candidates, tune_exact
from engine.quant.fp8 import FP8_DTYPE, FP8_MAX, quantize_rows, quantize_weight

GROUP = 128  # the block-scaled GEMM's scale group along K


def group_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] -> (e4m3 [R, K], float32 [R, K / 128]): one scale per 128 values of a row."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    scale = groups.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (groups / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(x.shape), scale


def candidates(
    x: torch.Tensor, weight: torch.Tensor
) -> dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]]:
    """name -> (op, the float32 product its quantized operands stand for)."""
    rows = quantize_weight(weight)
    w_row_scale = rows.scale.reshape(1, -1).contiguous()
    x_q, x_scale = quantize_rows(x, None)
    want_rows = (x_q.float() * x_scale) @ (rows.weight.float() * rows.scale).t()
    one = torch.ones((), device="cuda")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16, device="cuda")
    unit_product = x_q.float() @ rows.weight.float().t()
    a3, b3, out3 = x_q.unsqueeze(0), rows.weight.t().unsqueeze(0), out.unsqueeze(0)

    def rowwise() -> torch.Tensor:
        return torch._scaled_mm(
            x_q, rows.weight.t(), scale_a=x_scale, scale_b=w_row_scale,
            out_dtype=torch.bfloat16, use_fast_accum=True,
        )  # fmt: skip

    def tensorwise() -> torch.Tensor:
        return torch._scaled_mm(
            x_q, rows.weight.t(), scale_a=one, scale_b=one,
            out_dtype=torch.bfloat16, use_fast_accum=True,
        )  # fmt: skip

    def cublaslt() -> torch.Tensor:
        import flashinfer

        return flashinfer.bmm_fp8(a3, b3, one, one, torch.bfloat16, out=out3, backend="cublas")

    x_g, x_g_scale = group_quantize(x)
    w_g, w_g_scale = group_quantize(weight)
    want_groups = (x_g.float().reshape(x.shape[0], -1, GROUP) * x_g_scale.unsqueeze(-1)).reshape(
        x.shape
    ) @ (w_g.float().reshape(weight.shape[0], -1, GROUP) * w_g_scale.unsqueeze(-1)).reshape(
        weight.shape
    ).t()

    x_g_scale_m_major = x_g_scale.t().contiguous().t()  # DeepGEMM's own layout for A's scales

    def block_scaled() -> torch.Tensor:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        return fp8_blockscale_gemm_sm90(x_g, w_g, x_g_scale, w_g_scale, out=out)

    def block_scaled_m_major() -> torch.Tensor:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90

        return fp8_blockscale_gemm_sm90(x_g, w_g, x_g_scale_m_major, w_g_scale, out=out)

    return {
        "rowwise (engine)": (rowwise, want_rows),
        "tensorwise": (tensorwise, unit_product),
        "cublaslt heuristic": (cublaslt, unit_product),
        "cublaslt tuned": (cublaslt, unit_product),
        "deepgemm 1x128": (block_scaled, want_groups),
        "deepgemm, M-major": (block_scaled_m_major, want_groups),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[16384, 768, 232])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for num_rows in args.rows:
        row = time_candidates(num_rows, gen, candidates, {"cublaslt tuned"}, tune_exact)
        results.append(row)
        print_step(row)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": results}))


if __name__ == "__main__":
    main()
