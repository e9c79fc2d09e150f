"""The o_proj prefetch during attention (engine/models/weight_prefetch.py) on a GPU: the kernel
asks for the lines the budget allows, eagerly and forked onto its side stream inside a captured
graph (whose replays then give the eager result), and the tiny bf16 engine on graphs, batch-1
steps on the fused GEMVs, gives the same logits and tokens with it as without it (it only
reads)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.models import weight_prefetch
from tests.gpu.test_flashinfer_backend import Recorder
from tests.gpu.test_fp8_weights import CUDA, engine_on, load, pytestmark, tiny  # noqa: F401
from tests.gpu.test_fused_gemv_cuda import solo_requests
from tests.unit.test_weight_prefetch import budget_env  # noqa: F401 (fixture)


@pytest.fixture
def prefetches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The line count of every prefetch launched from here on (run or captured)."""
    counts: list[int] = []
    prefetch = weight_prefetch.prefetch

    def counted(weight: torch.Tensor, max_bytes: int) -> int:
        counts.append(prefetch(weight, max_bytes))
        return counts[-1]

    monkeypatch.setattr(weight_prefetch, "prefetch", counted)
    yield counts


@pytest.mark.parametrize("mib", [0, 1, 64])
def test_the_kernel_asks_for_the_budgets_lines(mib: int) -> None:
    weight = torch.randn(1000, 4096, device=CUDA).bfloat16()  # 7.8 MiB: 64 MiB takes it all
    lines = weight_prefetch.prefetch(weight, mib << 20)
    torch.cuda.synchronize()
    assert lines == min(mib << 20, weight.numel() * 2) // weight_prefetch.LINE_BYTES


def test_the_fork_inside_a_graph_replays_like_eager(prefetches: list[int]) -> None:
    weight = torch.randn(4096, 4096, device=CUDA).bfloat16()
    static = torch.randn(1, 4096, device=CUDA).bfloat16()

    def step() -> torch.Tensor:
        hidden = weight_prefetch.during(weight, 1, lambda: torch.tanh(static @ weight))
        return hidden @ weight

    want = step()  # compiles the kernel and the matmuls outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    assert len(prefetches) == 2 and prefetches[0] > 0
    for seed in range(3):
        static.copy_(
            torch.randn(1, 4096, device=CUDA, generator=torch.Generator(CUDA).manual_seed(seed))
        )
        want = step()
        graph.replay()
        assert torch.equal(out, want)


def test_tiny_bf16_engine_gives_the_same_logits_with_and_without_it(
    budget_env,  # noqa: F811
    prefetches: list[int],
    tiny: Path,  # noqa: F811
) -> None:
    model = load(tiny, quantization=None)
    budget_env.set("0")
    without = engine_on(model, tiny, cuda_graph=True)
    rec_without = Recorder(without)
    tokens = solo_requests(without)
    assert prefetches == []
    budget_env.set("32")
    with_it = engine_on(model, tiny, cuda_graph=True)
    assert len(prefetches) >= len(model.layers), "the batch-1 graph did not capture them"
    rec_with = Recorder(with_it)
    assert solo_requests(with_it) == tokens
    for req_id, logits in rec_without.logits.items():
        for a, b in zip(logits, rec_with.logits[req_id], strict=True):
            assert torch.equal(a, b)
