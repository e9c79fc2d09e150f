"""Few-row FP8 GEMMs alone on the Llama-3.1-8B projection shapes: the engine's two Triton GEMV
kernels (engine/quant/fp8_gemv.py: "dot", tl.dot over 16 padded rows, and "vector", plain
vector loads, for up to VECTOR_MAX_ROWS rows; each autotuned), cuBLASLt's FP8 GEMM after the
per-token quantization (Fp8Linear above 16 rows), cuBLAS on bf16 weights and the cheaper-decode
candidates of bench/lib/fp8_gemv_candidates.py (f16dot, bits for one row) and the engine's
fp8_dot_rows (fp8dot, with and without the activation quantization). Each is timed as
20 calls replayed from one CUDA graph (no launch gaps); the table gives us per call and the
weight bytes read per second, and the per-step sum over the 32 layers' four projections. Owns no
state; needs a GPU.

    python -m bench.fp8_gemv_bench [--rows 1 2 4 8 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.lib import fp8_gemv_candidates as candidates
from bench.lib.gpu_timing import chain_us
from engine.quant.fp8 import quantize_rows, quantize_weight
from engine.quant.fp8_dot_rows import fp8_dot_rows
from engine.quant.fp8_gemv import VECTOR_MAX_ROWS, fp8_gemv

SHAPES = {  # Llama-3.1-8B, one decoder layer: name -> (N, K)
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
NUM_LAYERS = 32
ITERS = 20


def graph_us(op: Callable[[], Any]) -> float:
    """Microseconds per call of op, called ITERS times in one CUDA graph, replayed 5 times."""
    return chain_us([op] * ITERS)


def one_shape(n: int, k: int, num_rows: int) -> dict[str, Any]:
    gen = torch.Generator("cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    q = quantize_weight(weight)
    scale = q.scale.reshape(1, -1).contiguous()
    bf16 = weight.bfloat16()
    del weight
    x = torch.randn(num_rows, k, device="cuda", generator=gen).bfloat16()
    want = x.float() @ (q.weight.float() * q.scale).t()

    def cublaslt() -> torch.Tensor:
        x_fp8, x_scale = quantize_rows(x, None)
        return torch._scaled_mm(
            x_fp8, q.weight.t(), scale_a=x_scale, scale_b=scale, out_dtype=torch.bfloat16
        )

    times = {
        "gemv_dot": graph_us(lambda: fp8_gemv(x, q.weight, scale, None, kernel="dot")),
        "cublaslt_fp8": graph_us(cublaslt),
        "bf16_cublas": graph_us(lambda: F.linear(x, bf16)),
    }
    if num_rows <= VECTOR_MAX_ROWS:
        got = fp8_gemv(x, q.weight, scale, None, kernel="vector")
        error = float((got.float() - want).abs().max() / want.abs().max())
        if error > 1e-2:
            raise AssertionError(f"vector GEMV, {num_rows} rows: relative error {error}")
        times["gemv_vector"] = graph_us(lambda: fp8_gemv(x, q.weight, scale, None, kernel="vector"))
    times |= candidate_times(x, q.weight, scale.reshape(-1), want)
    fp8_bytes = n * k
    row = {"n": n, "k": k, "rows": num_rows, "us": times}
    row["weight_GBps"] = {
        name: (2 * fp8_bytes if name == "bf16_cublas" else fp8_bytes) / us / 1e3
        for name, us in times.items()
    }
    return row


def candidate_times(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, want: torch.Tensor
) -> dict[str, float]:
    """us per call of the candidates and of fp8_dot_rows, each checked against want
    first (a wrong one raises; one Triton cannot build is left out with its error printed)."""
    x_fp8, x_scale = quantize_rows(x, None)
    ops = {
        "f16dot": lambda: candidates.gemv_f16dot(x, weight, scale),
        "fp8dot": lambda: fp8_dot_rows(x_fp8, x_scale, weight, scale, None),
        "fp8dot_quant": lambda: fp8_dot_rows(*quantize_rows(x, None), weight, scale, None),
    }
    if x.shape[0] == 1:
        ops["bits"] = lambda: candidates.gemv_bits(x, weight, scale)
    times = {}
    for name, op in ops.items():
        try:
            error = float((op().float() - want).abs().max() / want.abs().max())
        except Exception as exc:  # a candidate Triton cannot compile is a result
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        if error > (5e-2 if name.startswith("fp8dot") else 1e-2):
            raise AssertionError(f"{name}, {x.shape[0]} rows: relative error {error}")
        times[name] = graph_us(op)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for num_rows in args.rows:
        step_ms: dict[str, float] = {}
        for name, (n, k) in SHAPES.items():
            row = one_shape(n, k, num_rows) | {"name": name}
            rows.append(row)
            for kernel, us in row["us"].items():
                step_ms[kernel] = step_ms.get(kernel, 0.0) + us * NUM_LAYERS / 1e3
            cells = "  ".join(
                f"{kernel} {us:7.1f} us {row['weight_GBps'][kernel]:6.0f} GB/s"
                for kernel, us in row["us"].items()
            )
            print(f"M={num_rows:2d} {name:13s} {cells}")
        totals = "  ".join(f"{kernel} {ms:.3f} ms" for kernel, ms in step_ms.items())
        print(f"M={num_rows:2d} per step (32 layers x 4 projections): {totals}", flush=True)
        rows.append({"rows": num_rows, "step_ms": step_ms})
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
