"""The fused one-row GEMVs (engine/models/fused_gemv.py) on float32 tensors, in Triton's
interpreter on the CPU (tests/conftest.py turns it on where there is no GPU) or on a GPU:
RMSNorm before, SiLU-and-mul after and the in-place residual add against torch math, at sizes
that leave partial tiles; and when a step takes them (rows, device, plain projections). bf16
rounding and the engine are left to tests/gpu/test_fused_gemv_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models import fused_gemv
from engine.quant.fp8 import Fp8Linear
from tests.triton_device import DEVICE, needs_triton_kernels

pytest.importorskip("triton")

EPS = 1e-5


@pytest.fixture
def gemv_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per fused-GEMV launch from here on (a kernel call, captured or run)."""
    launches: list[int] = []
    launch = fused_gemv._launch

    def counted(*args, **kwargs) -> torch.Tensor:
        launches.append(1)
        return launch(*args, **kwargs)

    monkeypatch.setattr(fused_gemv, "_launch", counted)
    return launches


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def rms_normed(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight


@needs_triton_kernels
@pytest.mark.parametrize("n, k", [(37, 300), (16, 128)], ids=["partial-tiles", "whole-tiles"])
def test_normed_gemv_is_the_norm_then_the_product(n: int, k: int) -> None:
    num_rows = 1
    h, norm, w = randn(num_rows, k, seed=1), randn(k, seed=2), randn(n, k, seed=3)
    got = fused_gemv.normed_gemv(h, norm, EPS, w)
    want = rms_normed(h, norm) @ w.T
    assert got.shape == (num_rows, n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@needs_triton_kernels
def test_normed_gemv_silu_pairs_each_gate_channel_with_its_up_channel() -> None:
    num_rows, n, k = 1, 37, 300
    h, norm, w = randn(num_rows, k, seed=4), randn(k, seed=5), randn(2 * n, k, seed=6)
    got = fused_gemv.normed_gemv_silu(h, norm, EPS, w)
    gate_up = rms_normed(h, norm) @ w.T
    want = F.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert got.shape == (num_rows, n)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@needs_triton_kernels
def test_gemv_add_adds_the_product_into_the_residual_in_place() -> None:
    num_rows, n, k = 1, 37, 300
    x, w, residual = randn(num_rows, k, seed=7), randn(n, k, seed=8), randn(num_rows, n, seed=9)
    want = residual + x @ w.T
    storage = residual.data_ptr()
    fused_gemv.gemv_add_(x, w, residual)
    assert residual.data_ptr() == storage
    torch.testing.assert_close(residual, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_the_kernels_refuse_what_they_cannot_take() -> None:
    x = torch.zeros(fused_gemv.MAX_ROWS + 1, 8)
    with pytest.raises(ValueError, match="at most 1 row"):
        fused_gemv.gemv_add_(x, torch.zeros(4, 8), torch.zeros(x.shape[0], 4))
    with pytest.raises(ValueError, match=r"contiguous \[6, 8\]"):  # an odd gate_up
        fused_gemv.normed_gemv_silu(torch.zeros(1, 8), torch.ones(8), EPS, torch.zeros(7, 8))
    with pytest.raises(ValueError, match=r"contiguous \[4, 8\]"):
        fused_gemv.gemv_add_(torch.zeros(1, 8), torch.zeros(8, 4).t(), torch.zeros(1, 4))


def test_the_launcher_refuses_operands_it_would_misread() -> None:
    x, w = torch.zeros(1, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="shares the residual's storage"):
        both = torch.zeros(1, 12)
        fused_gemv.gemv_add_(both[:, :8], w, both[:, 8:])
    with pytest.raises(ValueError, match=r"output must be \[1, 4\]"):
        fused_gemv._launch(x, w, torch.zeros(1, 5), 4)
    with pytest.raises(ValueError, match=r"norm's weight must be contiguous \[8\]"):
        fused_gemv.normed_gemv(x, torch.ones(9), EPS, w)
    with pytest.raises(ValueError, match="writes into the residual itself"):
        fused_gemv._launch(x, w, torch.zeros(1, 4), 4, residual=torch.zeros(1, 4))


def test_which_steps_take_the_fused_gemvs() -> None:
    plain = [nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)]
    cuda_row = torch.zeros(1, 8, dtype=torch.bfloat16, device="meta")
    assert not fused_gemv.takes(torch.zeros(1, 8, dtype=torch.bfloat16), plain), "CPU tensor"
    assert fused_gemv.plain_linear(plain[0], torch.bfloat16)
    assert not fused_gemv.plain_linear(nn.Linear(8, 8, dtype=torch.bfloat16), torch.bfloat16)
    assert not fused_gemv.plain_linear(plain[0], torch.float16), "another dtype"
    assert not fused_gemv.plain_linear(Fp8Linear(16, 16, False, False), torch.bfloat16)
    assert not fused_gemv.takes(cuda_row, plain)  # a meta tensor is not CUDA either


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA tensor")
def test_a_cuda_step_takes_them_by_its_rows() -> None:
    plain = [nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)]
    one, two = (torch.zeros(n, 8, dtype=torch.bfloat16, device="cuda") for n in (1, 2))
    assert fused_gemv.takes(one, plain)
    assert not fused_gemv.takes(two, plain)
    assert not fused_gemv.takes(one, []), "a projection that is not plain"


def test_each_projection_kind_gets_its_measured_tile_within_the_register_budget() -> None:
    kinds = {"qkv": (True, False), "gate_up": (True, True), "o_down": (False, False)}
    tiles = {name: fused_gemv.tile_for(*kind) for name, kind in kinds.items()}
    assert tiles["qkv"] == fused_gemv.NORMED_TILE
    assert tiles["gate_up"] == tiles["o_down"] == fused_gemv.OTHER_TILE
    for name, (block_n, block_k, warps) in tiles.items():
        floats = block_n * block_k * (2 if name == "gate_up" else 1)
        assert floats <= fused_gemv.ACCUMULATOR_FLOATS_PER_THREAD * 32 * warps, name
