"""The non-attention kernels of an FP8 8B step at the offline run's step sizes (16,384-token
prefill steps, batch-768 and batch-232 decodes), each alone, timed as bench.fp8_gemv_bench
times them (graph replays): cuBLASLt's row-scaled FP8 GEMM with exact and with fast
accumulation; the FP8 input quantization unfused (add + RMSNorm or SiLU-and-mul, then
quantize_rows) against fused (engine/quant/fp8_fused.py); RoPE + KV write with one head per
program against the token-blocked launch; the engine's SiLU-and-mul + quantize against the
chunked two-pass kernel of engine/quant/fp8_silu_chunked.py in several settings, on bf16 rows
and on an Fp8Linear's ScaledRows (run it without KVRELAY_FP8_SILU_CHUNKED: "engine" is then
the whole-row kernel). Prints per-step milliseconds over the 32 layers. Owns no state; needs a
GPU.

    python -m bench.fp8_step_kernels_bench [--rows 16384 768 232] [--parts gemm quantization
        rope silu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from bench.fp8_gemv_bench import NUM_LAYERS, SHAPES, graph_us
from engine.attention import rope_kv_kernel
from engine.models import fused_ops
from engine.quant.fp8 import ScaledRows, quantize_rows, quantize_weight
from engine.quant.fp8_fused import add_rms_norm_quantize, silu_and_mul_quantize
from engine.quant.fp8_silu_chunked import ChunkedSilu

HIDDEN, INTER, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128


def gemms(num_rows: int, gen: torch.Generator) -> dict[str, Any]:
    """Per-step ms and TFLOP/s of the four projections, exact and fast accumulation."""
    step_ms = {"exact": 0.0, "fast": 0.0}
    flops = 0
    worst = 0.0
    for n, k in SHAPES.values():
        weight = quantize_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
        w_scale = weight.scale.reshape(1, -1).contiguous()
        x_fp8, x_scale = quantize_rows(
            torch.randn(num_rows, k, device="cuda", generator=gen).bfloat16(), None
        )

        def mm(fast: bool, x=x_fp8, xs=x_scale, w=weight.weight, ws=w_scale) -> torch.Tensor:
            return torch._scaled_mm(
                x, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, use_fast_accum=fast
            )

        exact, fast = mm(False).float(), mm(True).float()
        worst = max(worst, float((fast - exact).abs().max() / exact.abs().max()))
        for mode in step_ms:
            step_ms[mode] += graph_us(lambda m=mode: mm(m == "fast")) * NUM_LAYERS / 1e3
        flops += 2 * num_rows * n * k * NUM_LAYERS
        del weight, x_fp8
    tflops = {mode: flops / (ms / 1e3) / 1e12 for mode, ms in step_ms.items()}
    return {"step_ms": step_ms, "tflops": tflops, "fast_vs_exact_max_rel": worst}


def quantization(num_rows: int, gen: torch.Generator) -> dict[str, float]:
    """Per-step ms of the inputs of qkv/gate_up (two add + RMSNorm per layer) and of down."""
    x = torch.randn(num_rows, HIDDEN, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(num_rows, HIDDEN, device="cuda", generator=gen).bfloat16()
    weight = torch.ones(HIDDEN, device="cuda").bfloat16()
    gate_up = torch.randn(num_rows, 2 * INTER, device="cuda", generator=gen).bfloat16()

    def norm_chain() -> Any:
        fused_ops.add_rms_norm_(x, residual, weight, 1e-5)
        return quantize_rows(x, None)

    times = {
        "norm_unfused": 2 * graph_us(norm_chain),
        "norm_fused": 2 * graph_us(lambda: add_rms_norm_quantize(x, residual, weight, 1e-5, None)),
        "silu_unfused": graph_us(lambda: quantize_rows(fused_ops.silu_and_mul(gate_up), None)),
        "silu_fused": graph_us(lambda: silu_and_mul_quantize(gate_up, None)),
    }
    return {name: us * NUM_LAYERS / 1e3 for name, us in times.items()}


def rope(num_rows: int, gen: torch.Generator) -> dict[str, float]:
    """Per-step ms of RoPE + KV write into an fp8 cache: one head per program, and blocked."""
    qkv = torch.randn(num_rows, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, device="cuda")
    positions = torch.randint(0, 2000, (num_rows,), device="cuda", generator=gen)
    cos_sin = torch.randn(2048, HEAD_DIM, device="cuda", generator=gen)
    num_blocks = num_rows // 16 + 1
    cache = torch.zeros(num_blocks, 2, 2, NUM_KV_HEADS, 16, HEAD_DIM, device="cuda")
    cache = cache.to(torch.float8_e4m3fn)[:, 0]
    slots = torch.randperm(num_blocks * 16, device="cuda", generator=gen)[:num_rows]
    qkv = qkv.bfloat16()

    def write() -> Any:
        return rope_kv_kernel.rope_and_write_kv(
            qkv, positions, cos_sin, cache, slots // 16, slots % 16, NUM_HEADS
        )

    wanted = rope_kv_kernel.PROGRAMS_WANTED
    blocked = graph_us(write)
    rope_kv_kernel.PROGRAMS_WANTED = 1 << 40  # every program one head: the old launch
    try:
        per_head = graph_us(write)
    finally:
        rope_kv_kernel.PROGRAMS_WANTED = wanted
    return {"per_head": per_head * NUM_LAYERS / 1e3, "blocked": blocked * NUM_LAYERS / 1e3}


def silu_variants(num_rows: int, gen: torch.Generator) -> dict[str, float]:
    """Per-step ms of SiLU-and-mul + quantize: the engine's whole-row kernel and the chunked one
    (cCHUNK wWARPS, r: recompute, s: scratch), on bf16 rows and on ScaledRows (_scaled); each
    candidate's codes are checked against the engine's first."""
    gate_up = torch.randn(num_rows, 2 * INTER, device="cuda", generator=gen).bfloat16()
    row_scale = torch.rand(num_rows, 1, device="cuda", generator=gen) * 0.02 + 1e-3
    col_scale = torch.rand(1, 2 * INTER, device="cuda", generator=gen) * 0.02 + 1e-3
    sources = {"": gate_up, "_scaled": ScaledRows(gate_up * 50, row_scale, col_scale)}
    times = {}
    for suffix, src in sources.items():
        want = silu_and_mul_quantize(src, None)
        times["engine" + suffix] = graph_us(lambda src=src: silu_and_mul_quantize(src, None))
        for chunk in (1024, 2048):
            for warps in (4, 8):
                for scratch in (False, True):
                    name = f"c{chunk}w{warps}{'s' if scratch else 'r'}{suffix}"
                    how = ChunkedSilu(chunk, warps, scratch)
                    got = silu_and_mul_quantize(src, None, chunked=how)
                    same = float((got.q.float() == want.q.float()).float().mean())
                    if not torch.equal(got.scale, want.scale) or same < 0.999:
                        raise AssertionError(f"{name}: {same:.4f} of the codes agree")
                    times[name] = graph_us(
                        lambda s=src, h=how: silu_and_mul_quantize(s, None, chunked=h)
                    )
    return {name: us * NUM_LAYERS / 1e3 for name, us in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[16384, 768, 232])
    p.add_argument("--parts", nargs="*", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    results = []
    for num_rows in args.rows:
        row = {"rows": num_rows} | {part: PARTS[part](num_rows, gen) for part in args.parts}
        results.append(row)
        if "gemm" in row:
            gemm = row["gemm"]
            print(
                f"M={num_rows:5d} GEMMs exact {gemm['step_ms']['exact']:7.2f} ms "
                f"({gemm['tflops']['exact']:5.0f} TFLOP/s), fast "
                f"{gemm['step_ms']['fast']:7.2f} ms ({gemm['tflops']['fast']:5.0f}); fast vs "
                f"exact max rel {gemm['fast_vs_exact_max_rel']:.1e}",
                flush=True,
            )
        for part in ("quantization", "rope", "silu"):
            if part in row:
                cells = "  ".join(f"{k} {v:.3f}" for k, v in row[part].items())
                print(f"M={num_rows:5d} {part} ms/step: {cells}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": results}))


PARTS = {"gemm": gemms, "quantization": quantization, "rope": rope, "silu": silu_variants}

if __name__ == "__main__":
    main()
