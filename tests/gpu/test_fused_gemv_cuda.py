"""The fused one-row GEMVs (engine/models/fused_gemv.py) on the GPU: in bf16 on the 8B
projection shapes against torch's product of the same bf16 operands; a layer's chain of them
replayed from a CUDA graph (with PDL where the GPU has it) against the same chain run eagerly;
and a tiny bf16 model through the engine on graphs with them (the engine's path for one-row
steps) against without (cuBLAS, as larger steps run): logits along one token trajectory, and
greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.engine import Engine
from engine.execution import pdl
from engine.models import fused_gemv
from engine.sampling.sampling_params import SamplingParams
from tests.gpu.test_flashinfer_backend import Recorder, first_divergence, logit_scale
from tests.gpu.test_fp8_weights import CUDA, engine_on, load, pytestmark, tiny  # noqa: F401
from tests.unit.test_fused_gemv import gemv_launches  # noqa: F401 (a fixture)

EPS = 1e-5
HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144  # Llama-3.1-8B


def weight(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, cols, device=CUDA, generator=gen) * cols**-0.5).bfloat16()


def close_to(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst error relative to the largest |value| wanted."""
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("num_rows", range(1, fused_gemv.MAX_ROWS + 1))
def test_bf16_kernels_on_the_8b_shapes_match_torch(num_rows: int) -> None:
    gen = torch.Generator(CUDA).manual_seed(0)
    h = torch.randn(num_rows, HIDDEN, device=CUDA, generator=gen).bfloat16()
    norm = (torch.rand(HIDDEN, device=CUDA, generator=gen) + 0.5).bfloat16()
    inv_rms = torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS)
    normed = (h.float() * inv_rms * norm.float()).bfloat16()  # the unfused GEMMs' bf16 input
    qkv, gate_up = weight(QKV, HIDDEN, gen), weight(2 * INTERMEDIATE, HIDDEN, gen)
    want = normed.float() @ qkv.float().T
    errors = {"qkv": close_to(fused_gemv.normed_gemv(h, norm, EPS, qkv), want)}
    product = normed.float() @ gate_up.float().T
    want = F.silu(product[:, :INTERMEDIATE]) * product[:, INTERMEDIATE:]
    errors["gate_up"] = close_to(fused_gemv.normed_gemv_silu(h, norm, EPS, gate_up), want)
    for name, (n, k) in {"o": (HIDDEN, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}.items():
        x = torch.randn(num_rows, k, device=CUDA, generator=gen).bfloat16()
        w, residual = weight(n, k, gen), h.clone()
        want = h.float() + x.float() @ w.float().T
        fused_gemv.gemv_add_(x, w, residual)
        errors[name] = close_to(residual, want)
    print(f"{num_rows} rows, worst error / max |value|: {errors}")
    assert max(errors.values()) < 1e-2  # bf16 rounding of the inputs the reference rounds too


PICKED_TILES = sorted(
    {
        fused_gemv.tile_for(norm, silu)
        for norm, silu in ((True, False), (True, True), (False, False))
    }
)


@pytest.mark.parametrize("chosen", PICKED_TILES, ids=lambda t: "x".join(map(str, t)))
def test_every_tile_the_engine_may_pick_is_right(chosen: tuple[int, int, int]):
    """Every tile tile_for picks for some projection, on the 8B gate/up and down shapes."""
    gen = torch.Generator(CUDA).manual_seed(2)
    h = torch.randn(1, HIDDEN, device=CUDA, generator=gen).bfloat16()
    norm = (torch.rand(HIDDEN, device=CUDA, generator=gen) + 0.5).bfloat16()
    normed = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS) * norm.float()
    gate_up, down = weight(2 * INTERMEDIATE, HIDDEN, gen), weight(HIDDEN, INTERMEDIATE, gen)
    out = h.new_empty(1, INTERMEDIATE)
    fused_gemv._launch(h, gate_up, out, INTERMEDIATE, norm=norm, eps=EPS, silu=True, tile=chosen)
    product = normed @ gate_up.float().T
    want = F.silu(product[:, :INTERMEDIATE]) * product[:, INTERMEDIATE:]
    assert close_to(out, want) < 1e-2
    residual = h.clone()
    fused_gemv._launch(out, down, residual, HIDDEN, residual=residual, tile=chosen)
    assert close_to(residual, h.float() + out.float() @ down.float().T) < 1e-2


def layer_chain(gen: torch.Generator) -> Callable[[torch.Tensor], torch.Tensor]:
    """One decoder layer's four GEMVs (attention left out: its input is qkv's first columns);
    the residual stream changes in place, each kernel reads the one before's output."""
    norms = [(torch.rand(HIDDEN, device=CUDA, generator=gen) + 0.5).bfloat16() for _ in range(2)]
    qkv, o = weight(QKV, HIDDEN, gen), weight(HIDDEN, HIDDEN, gen)
    gate_up, down = weight(2 * INTERMEDIATE, HIDDEN, gen), weight(HIDDEN, INTERMEDIATE, gen)

    def run(residual: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            q = fused_gemv.normed_gemv(residual, norms[0], EPS, qkv)[:, :HIDDEN]
            fused_gemv.gemv_add_(q, o, residual)
            hidden = fused_gemv.normed_gemv_silu(residual, norms[1], EPS, gate_up)
            fused_gemv.gemv_add_(hidden, down, residual)
        return residual

    return run


def test_a_layer_chain_replayed_from_a_graph_equals_it_run_eagerly_without_pdl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With PDL each kernel may start before the one before ends: a read before its wait
    would see the previous replay's rows. Without PDL (eager, the same tiles) is the truth."""
    gen = torch.Generator(CUDA).manual_seed(1)
    run = layer_chain(gen)
    inputs = [torch.randn(1, HIDDEN, device=CUDA, generator=gen).bfloat16() for _ in range(3)]
    with monkeypatch.context() as patch:
        patch.setattr(pdl, "enabled", lambda device: False)  # as on a GPU without PDL
        want = [run(x.clone()) for x in inputs]  # compiles outside the graph
    run(inputs[0].clone())  # the PDL variants compile outside the graph too
    static = inputs[0].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(static)
    for x, expected in zip(inputs, want, strict=True):
        static.copy_(x)
        graph.replay()
        assert torch.equal(static, expected), "a replay read a stale row (a wait missing)"


def solo_requests(engine: Engine) -> dict[str, list[int]]:
    """Requests one at a time (every decode step has one row), a 1-token prompt among them."""
    gen = torch.Generator().manual_seed(5)
    tokens: dict[str, list[int]] = {}
    for name, length in (("one-token", 1), ("short", 9), ("long", 70)):
        prompt = torch.randint(0, 512, (length,), generator=gen).tolist()
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        engine.add_request(name, prompt, params)
        tokens[name] = []
        while engine.has_unfinished_requests:
            for out in engine.step():
                tokens[out.req_id].extend(out.new_token_ids)
    engine.assert_no_leaks()
    return tokens


def test_tiny_bf16_engine_on_graphs_with_fused_gemvs(
    gemv_launches: list[int],  # noqa: F811
    tiny: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launches = gemv_launches
    model = load(tiny, quantization=None)
    with monkeypatch.context() as patch:
        patch.setattr(fused_gemv, "takes", lambda x, plain: False)  # cuBLAS, as larger steps
        plain = engine_on(model, tiny, cuda_graph=True)
        rec_plain = Recorder(plain)
        plain_tokens = solo_requests(plain)
    assert launches == [], "a step off the fused GEMVs ran one"
    eager = engine_on(model, tiny, cuda_graph=False)
    assert len(launches) >= 4, "an eager engine compiles the four kernels at its start"
    assert eager.runner.graphs is None
    launches.clear()
    fused = engine_on(model, tiny, cuda_graph=True)
    assert len(launches) >= 4 * len(model.layers), "the batch-1 graph did not capture them"
    rec_forced = Recorder(fused, forced=plain_tokens)
    solo_requests(fused)
    assert fused.runner.num_graph_steps > 0
    scale = logit_scale(rec_plain)
    errors = [
        float((a - b).abs().max())
        for r in rec_plain.logits
        for a, b in zip(rec_plain.logits[r], rec_forced.logits[r], strict=True)
    ]
    print(f"bf16 engine, fused GEMVs vs cuBLAS: max logit error {max(errors):.4f} of {scale:.2f}")
    assert max(errors) <= 0.02 * scale
    free = engine_on(model, tiny, cuda_graph=True)
    free_tokens = solo_requests(free)
    notes = first_divergence(plain_tokens, rec_plain.logits, free_tokens, 0.02 * scale)
    print("\n".join(notes) or "greedy tokens equal")
