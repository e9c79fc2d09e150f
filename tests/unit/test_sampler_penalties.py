"""Penalties, logit_bias and top logprobs in the sampler, on random logits: repetition against
transformers' RepetitionPenaltyLogitsProcessor, presence / frequency against OpenAI's formula."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from common.messages import GenerateRequest
from engine.sampling.logits_processing import process_logits, token_counts
from engine.sampling.sample_row import SampleRow
from engine.sampling.sampler import Sampler
from engine.sampling.sampling_params import SamplingParams
from engine.sampling.validation import InvalidField, check_sampling
from router.cluster_backend import _continuation

VOCAB = 50
CPU = torch.device("cpu")


def histories(seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt + output token ids, number of prompt tokens) for four rows, repeats included."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for length, num_prompt in [(12, 5), (30, 30), (7, 1), (20, 10)]:
        out.append((torch.randint(0, VOCAB, (length,), generator=g).tolist(), num_prompt))
    return out


def openai_penalties(
    logits: torch.Tensor, output_ids: list[int], presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's formula, one token at a time: mu[j] - c[j] * frequency - [c[j] > 0] * presence."""
    out = logits.clone()
    for token_id in set(output_ids):
        count = output_ids.count(token_id)
        out[token_id] -= count * frequency + presence
    return out


def test_repetition_penalty_equals_transformers() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    for penalty in (1.3, 0.7):
        params = SamplingParams(repetition_penalty=penalty)
        rows = [SampleRow(params, None, len(ids), ids, n) for ids, n in histories()]
        got = process_logits(logits, rows)
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        for i, (ids, _) in enumerate(histories()):
            want = hf(torch.tensor([ids]), logits[i : i + 1].clone())[0]
            torch.testing.assert_close(got[i], want)


def test_presence_and_frequency_follow_openai_over_output_tokens_only() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    settings = [(0.5, 0.0), (0.0, 1.5), (-1.0, 0.3), (2.0, -2.0)]
    rows = [
        SampleRow(SamplingParams(presence_penalty=p, frequency_penalty=f), None, 0, ids, n)
        for (ids, n), (p, f) in zip(histories(), settings, strict=True)
    ]
    got = process_logits(logits, rows)
    for i, ((ids, n), (p, f)) in enumerate(zip(histories(), settings, strict=True)):
        torch.testing.assert_close(got[i], openai_penalties(logits[i], ids[n:], p, f))
    assert torch.equal(got[1], logits[1])  # row 1 has no output yet: nothing to count


def test_logit_bias_is_added_and_rows_without_processing_are_untouched() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    rows = [
        SampleRow(SamplingParams(), None),
        SampleRow(SamplingParams(logit_bias={4: 100.0, 9: -5.5}), None),
        SampleRow(SamplingParams(logit_bias=((4, -100),)), None, 0, [4, 4], 0),
    ]
    got = process_logits(logits, rows)
    assert torch.equal(logits, before), "the step's logits are not written"
    assert torch.equal(got[0], logits[0])
    want = logits[1].clone()
    want[4] += 100.0
    want[9] -= 5.5
    torch.testing.assert_close(got[1], want)
    assert process_logits(logits, [SampleRow(SamplingParams(), None)] * 3) is logits


def test_penalties_and_bias_come_before_greedy_and_logprobs() -> None:
    logits = torch.tensor([[0.0, 4.0, 3.9, -1.0]])
    sampler = Sampler(CPU, seed=0)
    plain = SamplingParams(temperature=0, logprobs=True)
    assert sampler(logits, [SampleRow(plain, None)]).token_ids == [1]
    penalised = SamplingParams(temperature=0, presence_penalty=0.5, logprobs=True)
    result = sampler(logits, [SampleRow(penalised, None, 3, [2, 1, 1], 2)])
    assert result.token_ids == [2]  # token 1 was output once: 4.0 - 0.5 < 3.9
    processed = torch.tensor([0.0, 3.5, 3.9, -1.0])
    assert result.logprobs[0] == pytest.approx(torch.log_softmax(processed, -1)[2].item())
    biased = SamplingParams(temperature=0, logit_bias={3: 10.0})
    assert sampler(logits, [SampleRow(biased, None)]).token_ids == [3]
    for _ in range(20):  # random sampling sees the bias too: -100 bans a token
        banned = SamplingParams(temperature=1.0, logit_bias={1: -100.0, 2: -100.0})
        assert sampler(logits, [SampleRow(banned, None)]).token_ids[0] in (0, 3)


def test_top_logprobs_are_the_k_most_likely_of_log_softmax() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    rows = [
        SampleRow(SamplingParams(temperature=0, logprobs=True, top_logprobs=5), None),
        SampleRow(SamplingParams(temperature=0, logprobs=True), None),
        SampleRow(SamplingParams(temperature=0.8, logprobs=True, top_logprobs=2), None),
    ]
    result = Sampler(CPU, seed=0)(logits, rows)
    want = torch.log_softmax(logits, -1).topk(5, -1)
    assert result.top_logprobs is not None
    for i in range(3):
        ids = [t for t, _ in result.top_logprobs[i]]
        values = [v for _, v in result.top_logprobs[i]]
        assert ids == want.indices[i].tolist()
        assert values == pytest.approx(want.values[i].tolist(), abs=1e-6)
    assert result.token_ids[0] == result.top_logprobs[0][0][0]


def test_token_counts_ignore_padding() -> None:
    counts = token_counts([[1, 1, 3], [], [0]], 4, CPU)
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-3), "frequency_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
        (SamplingParams(repetition_penalty=1e-300), "repetition_penalty"),  # logits to inf
        (SamplingParams(repetition_penalty=101.0), "repetition_penalty"),
        (SamplingParams(top_k=2**63), "top_k"),  # overflowed a step's index tensor
        (SamplingParams(stop=[f"s{i}" for i in range(65)]), "stop"),  # held the event loop
        (SamplingParams(stop=["x" * 1025]), "stop"),
        (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={-1: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={3: 101.0}), "logit_bias"),
        (SamplingParams(logprobs=True, top_logprobs=21), "top_logprobs"),
        (SamplingParams(top_logprobs=2), "top_logprobs"),  # needs logprobs
    ],
)
def test_bad_values_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidField) as info:
        check_sampling(params, VOCAB)
    assert info.value.field == field


def test_a_migrated_leg_counts_the_sent_tokens_as_output() -> None:
    request = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=10, presence_penalty=1))
    first = _continuation(request, [7, 8], 1)
    assert first.prompt_token_ids == (1, 2, 3, 7, 8) and first.num_resumed_tokens == 2
    again = _continuation(request, [7, 8, 9, 5], 2)  # `sent` counts every leg's tokens
    assert again.num_resumed_tokens == 4 and again.sampling.max_tokens == 6
