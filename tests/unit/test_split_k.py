"""Split-K of the few-row FP8 products (engine/quant/split_k.py): the parts' rule and checks,
then fp8_dot_rows and fp8_one_row's GEMV split against unsplit (the same sums in another
order), their arrival counters back at zero after each call: on a GPU, or on the CPU in
Triton's interpreter (tests/conftest.py sets it)."""

from __future__ import annotations

import pytest
import torch

from engine.quant import split_k
from engine.quant.fp8 import quantize_rows_torch, quantize_weight
from engine.quant.fp8_dot_rows import fp8_dot_rows
from engine.quant.fp8_one_row import row_dot
from tests.triton_device import DEVICE, needs_triton_kernels

EPS = 1e-5


@pytest.fixture
def split_on(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(split_k.ENV, "1")
    split_k.enabled.cache_clear()
    yield
    monkeypatch.delenv(split_k.ENV)
    split_k.enabled.cache_clear()


def test_the_rule_is_off_by_default() -> None:
    split_k.enabled.cache_clear()
    assert not split_k.enabled()
    assert split_k.split_for(128, 14336, 512, 132) == 1


def test_the_rule_aims_at_programs_per_sm(split_on: None) -> None:
    # the 8B shape on an H200 (132 SMs): down and o (128 tiles of 32 channels), qkv (192),
    # gate/up (448 tiles of 64): 528 programs wanted
    assert split_k.split_for(128, 14336, 512, 132) == 4
    assert split_k.split_for(192, 4096, 512, 132) == 3
    assert split_k.split_for(448, 4096, 256, 132) == 1
    # never parts of fewer than MIN_STEPS_PER_PART steps: 4 steps make at most 2 parts
    assert split_k.split_for(4, 2048, 512, 132) == 2
    assert split_k.split_for(4, 512, 512, 132) == 1


def test_bad_splits_are_refused() -> None:
    with pytest.raises(ValueError, match=r"split_k must be 1\.\.4"):
        split_k.checked_split(5, 2048, 512)
    with pytest.raises(ValueError, match=r"split_k must be 1\.\.4"):
        split_k.checked_split(0, 2048, 512)
    with pytest.raises(ValueError, match="at most"):
        split_k.counters(torch.device("cpu"), split_k.COUNTER_SLOTS + 1)
    with pytest.raises(AttributeError, match="no attribute"):
        split_k.not_a_helper  # noqa: B018


def counters_at_zero() -> bool:
    return not split_k.counters(DEVICE, 1).any()


@needs_triton_kernels
@pytest.mark.parametrize("num_rows", [1, 3])
def test_dot_rows_split_matches_unsplit(num_rows: int) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    n, k = 40, 200  # 3 tiles of 16 over 7 steps of 32: the last part is short
    weight = quantize_weight(torch.randn(n, k, generator=gen) * 0.02)
    q, scale = quantize_rows_torch(torch.randn(num_rows, k, generator=gen).bfloat16(), None)
    w_scale = weight.scale.reshape(1, -1).float()
    operands = [t.to(DEVICE) for t in (q, scale, weight.weight, w_scale)]
    want = fp8_dot_rows(*operands, None, tile=(16, 32), split_k=1).float()
    for parts in (2, 3, 7):
        got = fp8_dot_rows(*operands, None, tile=(16, 32), split_k=parts).float()
        # float32 sums in another grouping, then rounded to bf16: equal or one bf16 step
        torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3 * float(want.abs().max()))
        assert counters_at_zero(), f"{parts} parts left a counter set"
        again = fp8_dot_rows(*operands, None, tile=(16, 32), split_k=parts).float()
        assert torch.equal(got, again), "the parts are summed in a fixed order"


@needs_triton_kernels
def test_dot_rows_takes_the_rule_when_on(split_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(9)
    n, k = 16, 256
    weight = quantize_weight(torch.randn(n, k, generator=gen) * 0.02)
    q, scale = quantize_rows_torch(torch.randn(1, k, generator=gen).bfloat16(), None)
    w_scale = weight.scale.reshape(1, -1).float()
    operands = [t.to(DEVICE) for t in (q, scale, weight.weight, w_scale)]
    # one tile over 8 steps: the rule asks for 4 parts (capped at 8 steps // 2 a part)
    assert split_k.split_for(1, k, 32, split_k.num_sms(DEVICE)) == 4
    asked = []
    real_counters = split_k.counters
    monkeypatch.setattr(split_k, "counters", lambda *a: asked.append(a) or real_counters(*a))
    got = fp8_dot_rows(*operands, None, tile=(16, 32)).float()
    assert asked == [(DEVICE, 1)], "the split path ran"
    want = (q.float() * scale) @ (weight.weight.float() * w_scale.t()).t()
    torch.testing.assert_close(got.cpu(), want, rtol=8e-3, atol=8e-3 * float(want.abs().max()))
    assert counters_at_zero()


@needs_triton_kernels
@pytest.mark.parametrize("fusion", ["norm", "add"])
def test_one_row_split_matches_unsplit(fusion: str) -> None:
    gen = torch.Generator().manual_seed(11)
    n, k = 40, 200
    weight = quantize_weight(torch.randn(n, k, generator=gen) * 0.02)
    x = (torch.randn(1, k, generator=gen) * 3).bfloat16().to(DEVICE)
    norm = (torch.rand(k, generator=gen) + 0.5).bfloat16().to(DEVICE)
    residual = torch.randn(1, n, generator=gen).bfloat16().to(DEVICE)
    fusions = {"norm": norm, "eps": EPS} if fusion == "norm" else {"add": True}
    tile = (16, 32, 4, 2)

    def run(parts: int) -> torch.Tensor:
        out = residual.clone()
        w, s = weight.weight.to(DEVICE), weight.scale.float().to(DEVICE)
        return row_dot(x, w, s, out, tile, split_k=parts, **fusions).float()

    want = run(1)
    for parts in (2, 7):
        got = run(parts)
        torch.testing.assert_close(got, want, rtol=8e-3, atol=8e-3 * float(want.abs().max()))
        assert counters_at_zero()
    if fusion == "add":
        assert not torch.equal(want, residual.float()), "the product went into the residual"


@needs_triton_kernels
def test_one_row_silu_takes_no_split() -> None:
    weight = quantize_weight(torch.randn(32, 64) * 0.02)
    out = torch.zeros(1, 16, dtype=torch.bfloat16, device=DEVICE)
    x = torch.randn(1, 64).bfloat16().to(DEVICE)
    w, s = weight.weight.to(DEVICE), weight.scale.float().to(DEVICE)
    with pytest.raises(ValueError, match="SiLU pairing takes no split_k"):
        row_dot(x, w, s, out, (16, 32, 4, 2), silu=True, split_k=2)
