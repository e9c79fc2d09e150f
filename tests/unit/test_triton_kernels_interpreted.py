"""The GPU path's Triton kernels on float32 tensors: on a GPU, or on the CPU in Triton's
interpreter (which tests/conftest.py turns on where there is no GPU): the RoPE + paged KV write
at every head blocking, and the input quantization of Fp8Linear (alone, and fused into add +
RMSNorm and SiLU-and-mul) against torch math. Rounding to bf16 and e4m3 is left to the GPU
tests (tests/gpu/test_fused_ops.py, test_fp8_weights.py); here every dtype is float32, so the
kernels' casts are exact and the math must match to float rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import rope_kv_kernel
from engine.models.rope import RotaryEmbedding
from engine.quant import fp8_fused
from engine.quant.fp8_types import AMAX_FLOOR, FP8_MAX
from tests.factories import make_model_config
from tests.triton_device import DEVICE, needs_triton_kernels

pytest.importorskip("triton")


pytestmark = needs_triton_kernels


@pytest.mark.parametrize("programs_wanted", [1024, 16, 1], ids=["one-head", "blocks", "token"])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (9, 3)], ids=["pow2", "smollm2"])
def test_rope_and_kv_write_at_every_head_blocking(
    monkeypatch: pytest.MonkeyPatch, programs_wanted: int, num_heads: int, num_kv_heads: int
) -> None:
    monkeypatch.setattr(rope_kv_kernel, "PROGRAMS_WANTED", programs_wanted)
    head_dim, num_tokens, block_size = 16, 12, 4
    config = make_model_config(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope_theta=10000.0
    )
    rope = RotaryEmbedding(config, 256).to(DEVICE)
    gen = torch.Generator().manual_seed(0)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(DEVICE)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(8 * block_size, generator=gen)[:num_tokens].to(DEVICE)
    block_ids, offsets = slots // block_size, slots % block_size
    q, k, v = qkv.clone().split([q_size, kv_size, kv_size], dim=-1)
    want_q, want_k = rope(
        positions, q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)
    )
    cache = torch.zeros(8, 2, 2, num_kv_heads, block_size, head_dim, device=DEVICE)  # 2 layers
    kv_scales = (2.0, 0.5)
    got_q = rope_kv_kernel.rope_and_write_kv(
        qkv, positions, rope.cos_sin, cache[:, 1], block_ids, offsets, num_heads, kv_scales
    )
    heads = num_heads + num_kv_heads
    per_program = rope_kv_kernel.heads_per_program(num_tokens, heads)
    if programs_wanted == 1024:
        assert per_program == 1
    elif programs_wanted == 16:
        assert 1 < per_program < heads  # blocks that split a token's heads, q and k mixed
    else:
        assert per_program >= heads  # one program per token
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, q_size:], torch.cat([k, v], dim=-1))  # k and v rows untouched
    layer = cache[:, 1]
    torch.testing.assert_close(layer[block_ids, 0, :, offsets], want_k / 2.0, atol=1e-5, rtol=0)
    assert torch.equal(layer[block_ids, 1, :, offsets], v.view(-1, num_kv_heads, head_dim) / 0.5)
    written = torch.zeros(8, block_size, dtype=torch.bool, device=DEVICE)
    written[block_ids, offsets] = True
    assert not cache[:, 0].any()  # the other layer untouched
    assert not layer.permute(0, 3, 1, 2, 4)[~written].any()  # no other slot written


def small_rope_case(
    num_heads: int, num_kv_heads: int, head_dim: int, num_tokens: int, seed: int
) -> tuple[RotaryEmbedding, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """RoPE tables, random q|k|v rows, their positions and slots (blocks of 4), two empty caches."""
    block_size = 4
    config = make_model_config(
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope_theta=10000.0
    )
    rope = RotaryEmbedding(config, 64).to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen).to(DEVICE)
    block_ids = torch.arange(num_tokens, device=DEVICE) // block_size
    offsets = torch.arange(num_tokens, device=DEVICE) % block_size
    caches = [torch.zeros(2, 2, num_kv_heads, block_size, head_dim, device=DEVICE) for _ in "ab"]
    return rope, qkv.to(DEVICE), positions, block_ids, offsets, caches


def test_rope_writes_q_to_its_own_rows_when_given_them() -> None:
    """q_out: rotated q lands there (contiguous rows), and qkv is left as it was."""
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 16, 5
    rope, qkv, positions, block_ids, offsets, caches = small_rope_case(
        num_heads, num_kv_heads, head_dim, num_tokens, seed=6
    )
    before = qkv.clone()
    q_out = torch.full((num_tokens, num_heads, head_dim), float("nan"), device=DEVICE)
    got = rope_kv_kernel.rope_and_write_kv(
        qkv, positions, rope.cos_sin, caches[0], block_ids, offsets, num_heads, q_out=q_out
    )
    assert got is q_out and torch.equal(qkv, before)
    want = rope_kv_kernel.rope_and_write_kv(
        qkv, positions, rope.cos_sin, caches[1], block_ids, offsets, num_heads
    )
    assert torch.equal(got, want) and torch.equal(caches[0], caches[1])
    head_major = torch.empty(num_tokens, head_dim, num_heads, device=DEVICE).transpose(1, 2)
    with pytest.raises(ValueError, match="q_out"):  # the right shape, heads not by rows
        rope_kv_kernel.rope_and_write_kv(
            qkv, positions, rope.cos_sin, caches[0], block_ids, offsets, num_heads,
            q_out=head_major,
        )  # fmt: skip


@pytest.mark.parametrize("programs_wanted", [1024, 1], ids=["one-head", "token"])
@pytest.mark.parametrize("first_token", [0, 3])
def test_rope_leaves_rotated_k_and_v_in_kv_out(
    monkeypatch: pytest.MonkeyPatch, programs_wanted: int, first_token: int
) -> None:
    """kv_out: tokens from first_token on leave their rotated K and plain V, unscaled, there
    (ragged prefill attention reads them); the cache and q get what they get without it."""
    monkeypatch.setattr(rope_kv_kernel, "PROGRAMS_WANTED", programs_wanted)
    num_heads, num_kv_heads, head_dim, num_tokens = 6, 2, 16, 7
    rope, qkv, positions, block_ids, offsets, caches = small_rope_case(
        num_heads, num_kv_heads, head_dim, num_tokens, seed=11
    )
    kv_scales = (2.0, 0.5)
    # kv_out inside a larger buffer: a write for a token before first_token lands in the guard
    rows, guard = num_tokens - first_token, first_token + 1
    buffers = torch.full((2, guard + rows, num_kv_heads, head_dim), float("nan"), device=DEVICE)
    kv_out = rope_kv_kernel.KvOut(buffers[0, guard:], buffers[1, guard:], first_token)
    args = (positions, rope.cos_sin, caches[0], block_ids, offsets, num_heads, kv_scales)
    got_q = rope_kv_kernel.rope_and_write_kv(qkv.clone(), *args, kv_out=kv_out)
    plain_args = (positions, rope.cos_sin, caches[1], block_ids, offsets, num_heads, kv_scales)
    want_q = rope_kv_kernel.rope_and_write_kv(qkv.clone(), *plain_args)
    assert torch.equal(got_q, want_q) and torch.equal(caches[0], caches[1])
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    _, want_k = rope(
        positions, qkv[:, :q_size].reshape(-1, num_heads, head_dim),
        qkv[:, q_size : q_size + kv_size].reshape(-1, num_kv_heads, head_dim),
    )  # fmt: skip
    torch.testing.assert_close(kv_out.k, want_k[first_token:], atol=1e-5, rtol=1e-5)
    want_v = qkv[first_token:, q_size + kv_size :].reshape(-1, num_kv_heads, head_dim)
    assert torch.equal(kv_out.v, want_v)
    assert buffers[:, :guard].isnan().all()  # nothing written before first_token's row
    with pytest.raises(ValueError, match="kv_out"):
        short = rope_kv_kernel.KvOut(kv_out.k[1:], kv_out.v[1:], first_token)
        rope_kv_kernel.rope_and_write_kv(qkv.clone(), *args, kv_out=short)


def test_rope_builds_no_variant_per_the_per_token_rows_alignment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An eager step's positions and slot offsets are rows of a packed [4, T] tensor, 16-byte
    aligned only when T is even; read one element a program, they are not specialized on it."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled kernel's JITFunction, not built
    params = {p.name: p for p in rope_kv_kernel._kernel.__wrapped__().params}
    if not hasattr(params["positions_ptr"], "do_not_specialize_on_alignment"):
        pytest.skip("this Triton specializes every pointer on its alignment")
    exempt = {name for name, p in params.items() if p.do_not_specialize_on_alignment}
    assert exempt == set(rope_kv_kernel.PER_TOKEN_POINTERS)
    assert exempt <= {"positions_ptr", "slot_block_ptr", "slot_offset_ptr", "row_scale_ptr"}


def test_heads_per_program_fills_the_gpu_without_tiny_programs() -> None:
    heads = 32 + 8  # the 8B shape's q + k heads
    assert rope_kv_kernel.heads_per_program(1, heads) == 1
    assert rope_kv_kernel.heads_per_program(768, heads) == 16  # 768 x 3 programs
    assert rope_kv_kernel.heads_per_program(16384, heads) == 64  # one program per token


def expected_quantization(y: torch.Tensor, static: torch.Tensor | None) -> torch.Tensor:
    scale = y.abs().amax(-1, keepdim=True) / FP8_MAX if static is None else static.reshape(1, 1)
    return (y / scale).clamp(-FP8_MAX, FP8_MAX), scale.expand(y.shape[0], 1)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("add", [True, False], ids=["add", "first-layer"])
def test_add_rms_norm_quantize_math(add: bool, static: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen).to(DEVICE)
    residual = torch.randn(5, 96, generator=gen).to(DEVICE) if add else None
    weight = (torch.rand(96, generator=gen) + 0.5).to(DEVICE)
    static_scale = torch.tensor([[0.005]], device=DEVICE) if static else None
    before = None if residual is None else residual.clone()
    x_before = x.clone()
    got = fp8_fused.add_rms_norm_quantize(
        x, residual, weight, 1e-5, static_scale, out_dtype=torch.float32
    )
    summed = x_before if before is None else x_before + before
    normed = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    want_q, want_scale = expected_quantization(normed, static_scale)
    torch.testing.assert_close(got.scale, want_scale, atol=0, rtol=1e-5)
    torch.testing.assert_close(got.q, want_q, atol=1e-3, rtol=1e-5)
    assert torch.equal(x, x_before)  # the input is left as it is
    if residual is not None:
        torch.testing.assert_close(residual, summed)  # residual += x in place
    if static:
        assert got.q.abs().max() == FP8_MAX  # the static scale clips the large values


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_silu_and_mul_quantize_math(static: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(7, 2 * 80, generator=gen) * 3).to(DEVICE)
    static_scale = torch.tensor([[0.005]], device=DEVICE) if static else None
    got = fp8_fused.silu_and_mul_quantize(gate_up, static_scale, out_dtype=torch.float32)
    gate, up = gate_up.chunk(2, dim=-1)
    want_q, want_scale = expected_quantization(F.silu(gate) * up, static_scale)
    torch.testing.assert_close(got.scale, want_scale, atol=0, rtol=1e-5)
    torch.testing.assert_close(got.q, want_q, atol=1e-3, rtol=1e-5)
    assert got.q.shape == (7, 80) and got.q.is_contiguous()


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_quantize_rows_math(static: bool) -> None:
    """The per-row quantization alone (quantize_rows on CUDA), on rows strided in a wider
    tensor, with an all-zero row (the AMAX_FLOOR scale, no division by zero)."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 72, generator=gen) * 4).to(DEVICE)[:, :64]
    x[2] = 0.0
    static_scale = torch.tensor([[0.01]], device=DEVICE) if static else None
    got = fp8_fused._launch(fp8_fused.AS_IS, x, None, None, 0.0, 64, static_scale, torch.float32)
    want_q, want_scale = expected_quantization(x, static_scale)
    if not static:
        want_scale = want_scale.clamp(min=AMAX_FLOOR / FP8_MAX)
        want_q = (x / want_scale).clamp(-FP8_MAX, FP8_MAX)
    torch.testing.assert_close(got.scale, want_scale, atol=0, rtol=1e-5)
    torch.testing.assert_close(got.q, want_q, atol=1e-3, rtol=1e-5)
    assert not got.q[2].any()


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="gate_up"):
        fp8_fused.silu_and_mul_quantize(torch.zeros(2, 5, device=DEVICE), None)
    with pytest.raises(ValueError, match="contiguous"):
        x = torch.zeros(4, 2, device=DEVICE).t()
        fp8_fused.add_rms_norm_quantize(x, None, torch.ones(2, device=DEVICE), 1e-5, None)
