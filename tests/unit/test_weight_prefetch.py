"""engine/models/weight_prefetch.py off the GPU: its byte budget from the environment (default,
0, refused values named), and that nothing forks or prefetches where it does not apply (CPU
tensors, many rows, a budget of 0): the work runs once and its result comes back. The kernel
and the fork under graph capture are tests/gpu/test_weight_prefetch_cuda.py's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.models import weight_prefetch


@pytest.fixture
def budget_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """set(value): KVRELAY_ATTN_PREFETCH_MIB for what follows (re-read)."""

    class Env:
        def set(self, value: str) -> None:
            monkeypatch.setenv(weight_prefetch.ENV, value)
            weight_prefetch.budget_bytes.cache_clear()

    weight_prefetch.budget_bytes.cache_clear()
    yield Env()
    monkeypatch.delenv(weight_prefetch.ENV, raising=False)
    weight_prefetch.budget_bytes.cache_clear()


def test_the_budget_defaults_and_reads_whole_mib(budget_env) -> None:
    assert weight_prefetch.budget_bytes() == weight_prefetch.PREFETCH_MIB_DEFAULT << 20
    budget_env.set(" 8 ")
    assert weight_prefetch.budget_bytes() == 8 << 20
    budget_env.set("0")
    assert weight_prefetch.budget_bytes() == 0


@pytest.mark.parametrize("value", ["-1", "1.5", "lots", "2048"])
def test_a_bad_budget_is_refused_by_name(budget_env, value: str) -> None:
    budget_env.set(value)
    with pytest.raises(ValueError, match=weight_prefetch.ENV):
        weight_prefetch.budget_bytes()


def test_nothing_is_prefetched_off_the_gpu_or_for_many_rows(budget_env) -> None:
    weight = torch.ones(64, 64)
    assert not weight_prefetch.applies(weight, 1)
    calls: list[int] = []

    def work() -> torch.Tensor:
        calls.append(1)
        return weight * 2

    out = weight_prefetch.during(weight, 1, work)
    assert calls == [1] and torch.equal(out, weight * 2)
    if torch.cuda.is_available():
        on_gpu = weight.cuda()
        assert weight_prefetch.applies(on_gpu, 1)
        assert not weight_prefetch.applies(on_gpu, weight_prefetch.MAX_ROWS + 1)
        assert not weight_prefetch.applies(on_gpu, 0)
        budget_env.set("0")
        assert not weight_prefetch.applies(on_gpu, 1)


def test_only_a_contiguous_weight_is_prefetched() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        weight_prefetch.prefetch(torch.ones(8, 8).t(), 1 << 20)
