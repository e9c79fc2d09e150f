"""The values FP8 linears and their kernels pass between them: the e4m3 constants, quantized
input rows (QuantizedRows) and products whose scales are not applied yet (ScaledRows). Owns no
state.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
AMAX_FLOOR = 1e-12  # an all-zero row gets a tiny scale, not a division by zero


class QuantizedRows(NamedTuple):
    """An Fp8Linear's input already quantized: e4m3 [M, K] and float32 [M, 1], x ~ q * scale."""

    q: torch.Tensor
    scale: torch.Tensor


class ScaledRows(NamedTuple):
    """An Fp8Linear's output with its scales not yet applied: value = raw * row_scale *
    col_scale, raw bf16 [M, N] (the e4m3 codes' product), row_scale float32 [M, 1] (the
    input's), col_scale float32 [1, N] (the weight's)."""

    raw: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    def materialize(self) -> torch.Tensor:
        """The bf16 value, as the row-scaled GEMM would have written it."""
        return (self.raw.float() * self.row_scale * self.col_scale).to(self.raw.dtype)


def materialized(x: torch.Tensor | ScaledRows) -> torch.Tensor:
    """x itself, or the value of ScaledRows (for readers that do not apply scales)."""
    return x.materialize() if isinstance(x, ScaledRows) else x
