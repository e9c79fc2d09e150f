"""Sampler: greedy, filters, per-request seeds and logprobs on hand-made logits."""

from __future__ import annotations

import dataclasses
import math

import torch

from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_params import SamplingParams


def rows(
    *params: SamplingParams, seeds: tuple[int | None, ...] = (), position: int = 0
) -> list[SampleRow]:
    out = []
    for i, p in enumerate(params):
        seed = seeds[i] if i < len(seeds) else None
        if seed is not None:
            p = dataclasses.replace(p, seed=seed)
        out.append(SampleRow(p, torch.Generator() if seed is not None else None, position))
    return out


LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 4.9]])


def test_greedy_is_argmax():
    result = Sampler(torch.device("cpu"), seed=0)(
        LOGITS, rows(SamplingParams(temperature=0), SamplingParams(temperature=0))
    )
    assert result.token_ids == [1, 0] and result.logprobs is None


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """1e-40 divided the logits into inf: the served text was end-of-text tokens."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    for _ in range(20):
        tiny = SamplingParams(temperature=1e-40)
        assert tiny.greedy and sampler(LOGITS, rows(tiny, tiny)).token_ids == [1, 0]
    assert not SamplingParams(temperature=1e-3).greedy


def test_top_k_one_equals_greedy():
    sampler = Sampler(torch.device("cpu"), seed=0)
    for _ in range(20):
        result = sampler(LOGITS, rows(SamplingParams(top_k=1), SamplingParams(top_k=1)))
        assert result.token_ids == [1, 0]


def test_top_p_keeps_smallest_set():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[10.0, 9.0, -10.0, -10.0]])
    seen = {sampler(logits, rows(SamplingParams(top_p=0.9))).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


def test_min_p_drops_unlikely_tokens():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([[3.0, 3.0, -2.0, -2.0]])
    seen = {sampler(logits, rows(SamplingParams(min_p=0.5))).token_ids[0] for _ in range(200)}
    assert seen == {0, 1}


def test_seeded_rows_ignore_batch_mates():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.zeros(3, 1000)
    a = sampler(logits[:1], rows(SamplingParams(), seeds=(7,))).token_ids[0]
    b = sampler(
        logits, rows(SamplingParams(), SamplingParams(), SamplingParams(), seeds=(None, 7, None))
    ).token_ids[1]
    assert a == b


def test_logprobs_are_log_softmax_of_chosen():
    result = Sampler(torch.device("cpu"))(
        LOGITS, rows(SamplingParams(temperature=0, logprobs=True), SamplingParams(temperature=0))
    )
    expected = torch.log_softmax(LOGITS[0], -1)[1].item()
    assert math.isclose(result.logprobs[0], expected, rel_tol=1e-5)


def test_a_seeded_draw_depends_on_seed_and_position_only():
    """What lets a migrated request resume its random stream on another engine: the draw at a
    position is the same whatever was drawn before it, and differs between positions."""
    logits = torch.zeros(1, 1000)
    params = SamplingParams()

    def draw(position: int, seed: int = 7, sampler_seed: int = 0) -> int:
        sampler = Sampler(torch.device("cpu"), seed=sampler_seed)
        return sampler(logits, rows(params, seeds=(seed,), position=position)).token_ids[0]

    assert draw(40) == draw(40, sampler_seed=1)  # another engine, its own history
    assert len({draw(p) for p in range(40, 48)}) > 4  # positions draw differently
    assert draw(40, seed=8) != draw(40) or draw(41, seed=8) != draw(41)


def test_bf16_logits_widen_only_when_a_row_needs_more_than_the_argmax(monkeypatch):
    """Logits in the model's dtype: plain greedy steps take the argmax there (ties go to the
    first index, as in float32); logprobs and sampling work on a float32 copy, and the
    caller's logits are left as they are."""
    bf16 = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 0.0, 0.0, 4.9]], dtype=torch.bfloat16)
    before = bf16.clone()
    widened = []
    to_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.dtype) or to_float(t))
    greedy = SamplingParams(temperature=0)
    sampler = Sampler(torch.device("cpu"), seed=0)
    assert sampler(bf16, rows(greedy, greedy)).token_ids == [1, 0]
    assert widened == []  # the argmax on bf16: no float32 copy
    result = sampler(bf16, rows(dataclasses.replace(greedy, logprobs=True), greedy))
    expected = torch.log_softmax(bf16[0].float(), -1)[1].item()
    assert result.token_ids == [1, 0] and math.isclose(result.logprobs[0], expected, rel_tol=1e-6)
    assert torch.bfloat16 in widened
    assert sampler(bf16[1:], rows(SamplingParams(top_k=1))).token_ids == [0]
    assert torch.equal(bf16, before)
