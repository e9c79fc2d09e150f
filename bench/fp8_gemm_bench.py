"""FP8 GEMM kernels other than the engine's on the 8B projections at the offline run's step
sizes (16,384, 768 and 232 rows), each timed as bench.fp8_gemv_bench times them (graph
replays): the engine's torch._scaled_mm with row-wise scales (cuBLASLt's heuristic pick);
the same with one scale per tensor; FlashInfer's cuBLASLt FP8 GEMM (one scale per tensor) at
its heuristic pick and at the fastest of cuBLASLt's candidate algorithms (FlashInfer's
autotuner); FlashInfer's SM90 block-scaled GEMM (DeepGEMM: 1 x 128 input and weight scale
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
from typing import Any

import torch

from bench.fp8_gemv_bench import NUM_LAYERS, SHAPES, graph_us
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


def tune(op: Callable[[], torch.Tensor]) -> None:
    """Let FlashInfer's autotuner time cuBLASLt's candidate algorithms for op's shape."""
    from flashinfer.autotuner import autotune

    with autotune(True):
        op()
    torch.cuda.synchronize()


def one_step(num_rows: int, gen: torch.Generator) -> dict[str, Any]:
    """Per-step ms, TFLOP/s and worst relative error of every candidate at num_rows rows."""
    step_ms: dict[str, float] = {}
    errors: dict[str, str] = {}
    worst: dict[str, float] = {}
    flops = 0
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        x = torch.randn(num_rows, k, device="cuda", generator=gen).bfloat16()
        for label, (op, want) in candidates(x, weight).items():
            if label in errors:
                continue
            try:
                if label == "cublaslt tuned":
                    tune(op)
                got = op().float()
                rel = float((got - want).abs().max() / want.abs().max())
                us = graph_us(op)
            except Exception as error:  # a kernel this install lacks: reported, not fatal
                errors[label] = f"{name}: {type(error).__name__}: {error}"[:800]
                step_ms.pop(label, None)
                print(f"M={num_rows} {label}: {errors[label]}", flush=True)
                continue
            step_ms[label] = step_ms.get(label, 0.0) + us * NUM_LAYERS / 1e3
            worst[label] = max(worst.get(label, 0.0), rel)
            print(f"M={num_rows:5d} {name:12s} {label:20s} {us:8.1f} us  rel err {rel:.1e}")
        flops += 2 * num_rows * n * k * NUM_LAYERS
        del weight, x
    tflops = {label: flops / (ms / 1e3) / 1e12 for label, ms in step_ms.items()}
    return {"rows": num_rows, "step_ms": step_ms, "tflops": tflops, "max_rel": worst} | (
        {"errors": errors} if errors else {}
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[16384, 768, 232])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for num_rows in args.rows:
        row = one_step(num_rows, gen)
        results.append(row)
        for label, ms in row["step_ms"].items():
            print(
                f"M={num_rows:5d} {label:20s} {ms:8.2f} ms a step  "
                f"{row['tflops'][label]:6.0f} TFLOP/s  max rel err {row['max_rel'][label]:.1e}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": results}))


if __name__ == "__main__":
    main()
