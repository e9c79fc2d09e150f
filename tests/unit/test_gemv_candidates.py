"""bench/lib/gemv_candidates.py's kernel on float32 tensors, in Triton's interpreter on the CPU
(tests/conftest.py turns it on where there is no GPU) or on a GPU: each switch (the sum at each
K step, gate/up rows interleaved in blocks, SiLU formed from gate/up's plain output) against
torch math, at sizes that leave partial K tiles; and the interleaving itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.lib.gemv_candidates import candidate_gemv, interleave
from tests.triton_device import DEVICE, needs_triton_kernels

pytestmark = needs_triton_kernels
EPS = 1e-5
TILE = (8, 128, 4)  # BLOCK_N, BLOCK_K, warps: K = 300 leaves a partial K tile


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_interleave_puts_each_blocks_up_rows_after_its_gate_rows() -> None:
    gate_up = torch.arange(8.0).reshape(8, 1)  # gate rows 0-3, up rows 4-7
    assert interleave(gate_up, 2).flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    with pytest.raises(ValueError, match="blocks of 3"):
        interleave(gate_up, 3)


@pytest.mark.parametrize("sum_each_step", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("num_rows", [1, 2])
def test_normed_gate_up_with_silu(sum_each_step: bool, interleaved: bool, num_rows: int) -> None:
    n, k = 40, 300
    h, norm, w = randn(num_rows, k, seed=1), randn(k, seed=2), randn(2 * n, k, seed=3)
    weight = interleave(w, TILE[0]) if interleaved else w
    out = torch.zeros(num_rows, n, device=DEVICE)
    candidate_gemv(
        h, weight, out, TILE, norm=norm, eps=EPS, silu=True,
        sum_each_step=sum_each_step, interleaved=interleaved,
    )  # fmt: skip
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * norm
    gate_up = normed @ w.T
    close(out, F.silu(gate_up[:, :n]) * gate_up[:, n:])


@pytest.mark.parametrize("sum_each_step", [False, True])
@pytest.mark.parametrize("silu_input", [False, True])
def test_residual_add_with_the_silu_formed_from_its_input(
    sum_each_step: bool, silu_input: bool
) -> None:
    n, k = 37, 300
    x = randn(1, (2 if silu_input else 1) * k, seed=4)
    w, residual = randn(n, k, seed=5), randn(1, n, seed=6)
    want = residual + (F.silu(x[:, :k]) * x[:, k:] if silu_input else x) @ w.T
    candidate_gemv(
        x, w, residual, TILE, add=True, sum_each_step=sum_each_step, silu_input=silu_input
    )
    close(residual, want)


def test_the_candidates_refuse_what_they_would_misread() -> None:
    out = torch.zeros(1, 12, device=DEVICE)
    with pytest.raises(ValueError, match="interleaved"):
        candidate_gemv(randn(1, 16, seed=7), randn(24, 16, seed=8), out, TILE, silu=True,
                       interleaved=True)  # fmt: skip
    with pytest.raises(ValueError, match="no norm"):
        candidate_gemv(randn(1, 32, seed=7), randn(12, 16, seed=8), out, TILE,
                       norm=torch.ones(16, device=DEVICE), silu_input=True)  # fmt: skip
