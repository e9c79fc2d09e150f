"""The MoE experts' GPU path (engine/models/moe_kernels.py) against the torch reference
(moe.reference_experts): the alignment of routed pairs into per-expert blocks, and the two
grouped GEMMs at several token counts with experts that get no tokens; on a GPU, or on the CPU
in Triton's interpreter (tests/conftest.py sets it; it truncates bf16 casts, so bf16 is held to
a bf16 step there). On a GPU also the CUDA path of SparseMoe and a CUDA graph's capture. And the
kernels built for sm_90 (through tests/hopper_compile.py, in a child process without the
interpreter): the GEMMs must fit shared memory, spill nothing and pipeline their loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.models import moe_kernels
from engine.models.moe import Routing, SparseMoe, reference_experts
from tests.hopper_compile import HOPPER_SHARED_LIMIT, have_hopper_compiler
from tests.triton_device import DEVICE, needs_triton_kernels

pytest.importorskip("triton")

HIDDEN, EXPERT, TOP_K = 64, 32, 2
ROOT = Path(__file__).resolve().parents[2]


def routing(num_tokens: int, num_experts: int, used: int, dtype: torch.dtype, seed: int) -> Routing:
    """Each token's TOP_K distinct experts among the first `used` (the rest get no tokens),
    with random positive weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(used, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    assert ids.max() < num_experts
    return Routing(ids.to(DEVICE), weights.to(dtype).to(DEVICE))


def expert_weights(num_experts: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * EXPERT, HIDDEN, generator=gen) * 0.2
    down = torch.randn(num_experts, HIDDEN, EXPERT, generator=gen) * 0.2
    return gate_up.to(dtype).to(DEVICE), down.to(dtype).to(DEVICE)


@needs_triton_kernels
@pytest.mark.parametrize(
    "num_tokens, num_experts, used", [(1, 8, 8), (5, 4, 3), (33, 8, 5), (700, 128, 100)]
)
@pytest.mark.parametrize("block_m", [16, 32])
def test_align_puts_every_pair_once_in_its_experts_blocks(
    num_tokens: int, num_experts: int, used: int, block_m: int
) -> None:
    """Each pair once, in ascending order within its expert's run; each run padded to whole
    blocks with the padding index; each block of the run names the expert. 700 tokens x 2
    is more than one align chunk."""
    ids = routing(num_tokens, num_experts, used, torch.float32, seed=num_tokens).expert_ids
    aligned = moe_kernels.align(ids, num_experts, block_m)
    num_pairs = ids.numel()
    assert aligned.sorted_pairs.numel() == moe_kernels.max_padded(num_pairs, num_experts, block_m)
    counts = torch.bincount(ids.reshape(-1).cpu(), minlength=num_experts).tolist()
    num_padded = int(aligned.num_padded)
    assert num_padded == sum(-(-n // block_m) * block_m for n in counts)
    assert num_padded <= num_pairs + num_experts * (block_m - 1)
    pairs = aligned.sorted_pairs.cpu()[:num_padded].tolist()
    blocks = aligned.block_experts.cpu()[: num_padded // block_m].tolist()
    flat_ids = ids.reshape(-1).cpu().tolist()
    start = 0
    for expert, count in enumerate(counts):
        padded = -(-count // block_m) * block_m
        want = [p for p in range(num_pairs) if flat_ids[p] == expert]
        assert pairs[start : start + count] == want, expert
        assert pairs[start + count : start + padded] == [num_pairs] * (padded - count)
        assert blocks[start // block_m : (start + padded) // block_m] == [expert] * (
            padded // block_m
        )
        start += padded


@needs_triton_kernels
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
@pytest.mark.parametrize("num_experts, used", [(4, 4), (8, 5)], ids=["all-used", "idle-experts"])
@pytest.mark.parametrize(
    "weight_dtype", [torch.float32, "model"], ids=["f32-weights", "model-weights"]
)
def test_fused_experts_equal_the_reference_in_float32(
    num_tokens: int, num_experts: int, used: int, weight_dtype: torch.dtype | str
) -> None:
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    gate_up, down = expert_weights(num_experts, torch.float32, seed=num_experts)
    route = routing(num_tokens, num_experts, used, torch.float32, seed=num_tokens + used)
    want = reference_experts(x, route, gate_up, down)
    got = moe_kernels.fused_experts(x, *route, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().max() > 0.1


@needs_triton_kernels
@pytest.mark.parametrize("float32_weights", [True, False], ids=["mixtral", "qwen"])
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_fused_experts_in_bfloat16(num_tokens: int, float32_weights: bool) -> None:
    """Rounded where the reference rounds: on a GPU within a bf16 step or two of the output's
    scale (the GEMMs sum in another order) and mostly equal; in the interpreter, which
    truncates every bf16 cast (a bias that adds up over the products), within 2^-5 of it."""
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    x = x.bfloat16().to(DEVICE)
    gate_up, down = expert_weights(8, torch.bfloat16, seed=2)
    weights_dtype = torch.float32 if float32_weights else torch.bfloat16
    route = routing(num_tokens, 8, 6, weights_dtype, seed=3)
    want = reference_experts(x, route, gate_up, down)
    got = moe_kernels.fused_experts(x, *route, gate_up, down)
    assert got.dtype == torch.bfloat16
    step = 2**-5 if DEVICE.type == "cpu" else 2**-7  # bf16's step is 2^-8 relative
    scale = float(want.abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=step, atol=step * scale)
    assert scale > 1.0
    if DEVICE.type == "cuda":
        assert (got == want).float().mean() > 0.8


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA path and graphs need a GPU")
@pytest.mark.parametrize("shared", [0, 48], ids=["routed", "shared-expert"])
def test_sparse_moe_on_cuda_equals_its_cpu_path_and_captures_in_a_graph(shared: int) -> None:
    torch.manual_seed(0)
    moe = SparseMoe(HIDDEN, EXPERT, 8, TOP_K, True, shared_expert_size=shared)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.2)
    moe = moe.bfloat16()
    x = torch.randn(9, HIDDEN).bfloat16()
    with torch.no_grad():
        want = moe(x)
        moe.cuda()
        static_x = x.cuda()
        got = moe(static_x)
        scale = float(want.abs().max())  # within a bf16 step or two of it (GEMM sum order)
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=2**-7 * scale)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe(static_x)  # warm-up off the default stream, as graph capture wants
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = moe(static_x)
        other = torch.randn(9, HIDDEN).bfloat16()
        static_x.copy_(other)
        graph.replay()
        torch.testing.assert_close(static_out, moe(other.cuda()), rtol=0, atol=0)
        assert not torch.equal(static_out.cpu(), got.cpu())  # the replay read the new input


@pytest.mark.skipif(not have_hopper_compiler(), reason="needs triton's NVIDIA backend")
def test_the_grouped_gemm_builds_for_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", HOPPER_SCRIPT],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(built) == 5
    assert "error" not in built["align"], built["align"]["error"]
    assert built["align"]["local_bytes"] == 0
    for case, got in built.items():
        assert "error" not in got, (case, got.get("error"))
        if case == "align":
            continue
        assert got["shared"] <= HOPPER_SHARED_LIMIT, case
        assert got["local_bytes"] == 0, f"{case}: {got['registers']} registers a thread, spills"
        assert got["pipelined_loads"] > 0, f"{case}: tiles not loaded ahead"
        assert (got["exp2"] > 0) == case.startswith("gate_up"), f"{case}: the SiLU's exponential"


# bf16 experts as a model launches them: gate_up (SiLU fused, Qwen's bf16 weights unused) and
# down (weighted, float32 out) at the decode and prefill block heights.
HOPPER_SCRIPT = """
import json
from engine.models import moe_kernels as mk
from tests.hopper_compile import compile_for_hopper, facts
out = {}
for gated in (True, False):
    for num_pairs in (8, 8 * 2048):
        tile = mk.tile_for(num_pairs, 128)
        block_m = tile.block_m
        pointers = dict(
            a_ptr="bf16", w_ptr="bf16", out_ptr="bf16" if gated else "fp32",
            sorted_pairs_ptr="i32", block_experts_ptr="i32", num_padded_ptr="i32",
            weights_ptr="bf16",
        )
        constexprs = dict(
            GATED=gated, ROUND_WEIGHTED=True, UPCAST=False, BLOCK_M=block_m,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        )
        name = f"{'gate_up' if gated else 'down'} BLOCK_M={block_m}"
        try:
            built = compile_for_hopper(
                mk._kernel(), pointers, constexprs, num_warps=tile.warps,
                num_stages=tile.stages,
            )
            out[name] = facts(built)
        except Exception as error:
            out[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
try:
    pointers = dict(
        ids_ptr="i64", sorted_pairs_ptr="i32", block_experts_ptr="i32", num_padded_ptr="i32"
    )
    constexprs = dict(BLOCK_M=16, BINS=256, CHUNK=mk.ALIGN_CHUNK)
    out["align"] = facts(compile_for_hopper(mk._align_kernel(), pointers, constexprs, aligned=()))
except Exception as error:
    out["align"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
print(json.dumps(out))
"""
