"""fp8_gemv: y = x W^T for a few rows of bf16 x and an e4m3 W with per-channel scales, as one
Triton kernel that dequantizes W in registers; owns no state (imports triton on first use). Few
rows that come quantized take fp8_dot_rows.py instead (faster: no per-weight conversion); this
is for bf16 inputs (o_proj's).

A decode step of a few sequences is bound by reading the weights. cuBLASLt's FP8 GEMM picks a
128 x 128 tile for one row and reads the weights at about half the HBM rate, after a kernel
that quantizes the activations; these kernels skip that quantization (the activations stay
bf16, which is also closer to the unquantized model) and stream W once, BLOCK_N output
channels per program, tile shapes chosen per shape by Triton's autotuner on first use. Two
kernels: "dot" pads the rows to 16 and multiplies on tensor cores (tl.dot); "vector" multiplies
with plain vector loads and sums along K once at the end, for one or two rows. Inputs of up to
VECTOR_ROWS rows take "vector" (measured faster than "dot" for one row, slower for two), the
rest "dot".
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.execution import pdl

GEMV_MAX_ROWS = 16  # Fp8Linear takes these kernels up to here, cuBLASLt's FP8 GEMM above
VECTOR_ROWS = 1  # measured: "vector" faster than "dot" for one row, slower for two
VECTOR_MAX_ROWS = 2  # its fp32 accumulator is rows x BLOCK_N x BLOCK_K registers' worth
KERNELS = ("dot", "vector")


def kernel_for(num_rows: int) -> str:
    """The kernel fp8_gemv runs for this many input rows."""
    return "vector" if num_rows <= VECTOR_ROWS else "dot"


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in (
            (16, 128, 2, 6),
            (16, 256, 2, 4),
            (16, 512, 2, 3),
            (16, 128, 4, 8),
            (16, 256, 4, 4),
            (16, 512, 4, 3),
            (32, 128, 4, 6),
            (32, 256, 4, 4),
            (16, 1024, 8, 2),
            (32, 512, 8, 3),
        )
    ]

    @triton.autotune(configs=configs, key=["N", "K"])
    @triton.jit
    def fp8_gemv(
        x_ptr,
        w_ptr,
        scale_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        x_row_stride,
        out_row_stride,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per BLOCK_N output channels, all M (<= BLOCK_M) rows: acc += x_tile @
        dequant(w_tile)^T over K in fp32, then the channel scales (and bias). PDL: as in
        fp8_dot_rows (wait for the kernel before; the next kernel in after the loop)."""
        pid = tl.program_id(0)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            x = tl.load(
                x_ptr + rows[:, None] * x_row_stride + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
        out = acc * scale[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None] * out_row_stride + cols[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    return fp8_gemv


@functools.cache
def _vector_kernel() -> Any:
    import triton
    import triton.language as tl

    configs = [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
        for bn, bk, w in (
            (4, 1024, 4),
            (8, 512, 4),
            (8, 1024, 4),
            (8, 1024, 8),
            (16, 512, 4),
            (16, 1024, 8),
            (32, 256, 4),
            (8, 2048, 8),
        )
    ]

    def fits_registers(configs: list[Any], named_args: dict[str, Any], **kwargs: Any) -> list[Any]:
        """At most 64 accumulator floats a thread (rows x BLOCK_N x BLOCK_K over the threads)."""
        rows = kwargs.get("ROWS", named_args.get("ROWS", 1))
        return [
            c
            for c in configs
            if rows * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 64 * 32 * c.num_warps
        ] or configs[:1]

    @triton.autotune(
        configs=configs,
        key=["N", "K", "ROWS"],
        prune_configs_by={"early_config_prune": fits_registers},
    )
    @triton.jit
    def fp8_gemv_vector(
        x_ptr,
        w_ptr,
        scale_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        x_row_stride,
        out_row_stride,
        HAS_BIAS: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """One program per BLOCK_N output channels: acc[r, n, k] += x[r, k] * w[n, k] over
        the K tiles in fp32, summed along k once at the end, times the channel scales. PDL:
        as in fp8_dot_rows."""
        pid = tl.program_id(0)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        col_ok = cols < N
        row_ok = rows < M
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            w = tl.load(
                w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                mask=col_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            x = tl.load(
                x_ptr + rows[:, None] * x_row_stride + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += x[:, None, :] * w[None, :, :]
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        scale = tl.load(scale_ptr + cols, mask=col_ok, other=0.0)
        out = tl.sum(acc, axis=2) * scale[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rows[:, None] * out_row_stride + cols[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    return fp8_gemv_vector


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    kernel: str | None = None,
) -> torch.Tensor:
    """x [M, K] bf16 (M <= GEMV_MAX_ROWS, last dimension contiguous), weight e4m3 [N, K]
    contiguous, weight_scale float32 with N elements, bias [N] or None -> [M, N] in x's dtype.
    kernel: "dot" or "vector" (at most VECTOR_MAX_ROWS rows); None: kernel_for(M)."""
    import triton

    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv takes at most {GEMV_MAX_ROWS} rows, got {num_rows}")
    kernel = kernel or kernel_for(num_rows)
    if kernel not in KERNELS or (kernel == "vector" and num_rows > VECTOR_MAX_ROWS):
        raise ValueError(
            f"fp8_gemv kernel must be one of {KERNELS} (vector: <= {VECTOR_MAX_ROWS} rows), "
            f"got {kernel!r} for {num_rows} rows"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out

    def grid(meta: dict[str, Any]) -> tuple[int]:
        return (triton.cdiv(n, meta["BLOCK_N"]),)

    operands = (x, weight, weight_scale, weight_scale if bias is None else bias, out)
    use_pdl = pdl.enabled(x.device)  # bias is read only when HAS_BIAS
    sizes = (num_rows, n, k, x.stride(0), out.stride(0))
    flags = {"HAS_BIAS": bias is not None, "PDL": use_pdl, "launch_pdl": use_pdl}
    if kernel == "vector":
        rows = 1 << max(0, (num_rows - 1).bit_length())
        _vector_kernel()[grid](*operands, *sizes, **flags, ROWS=rows)
    else:
        _kernel()[grid](*operands, *sizes, **flags, BLOCK_M=GEMV_MAX_ROWS)
    return out
