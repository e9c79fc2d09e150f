"""Penalties, logit_bias and top logprobs through the engine on a tiny random model: greedy
output equals transformers' generate() with the same processors, top logprobs equal its
log_softmax, and overlapped steps, a split prefill/decode and a migrated leg count alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from engine.engine import Engine
from engine.llm import LLM
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import build_engine, run_to_completion
from tests.factories import greedy_continuation, make_tiny_checkpoint

PROMPTS = [[5, 17, 300, 42, 17, 5], list(range(1, 120, 3)), [7]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture
def make_tiny(checkpoint: Path) -> Iterator:
    engines: list[Engine] = []

    def factory(**overrides) -> Engine:
        engine = build_engine(model_path=str(checkpoint), num_blocks=64, **overrides)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.assert_no_leaks()


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's presence / frequency penalties over the generated tokens, then a logit bias."""

    def __init__(self, num_prompt: int, presence: float, frequency: float, bias: dict[int, float]):
        self.num_prompt, self.presence, self.frequency, self.bias = (
            num_prompt, presence, frequency, bias,
        )  # fmt: skip

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.num_prompt :].tolist()):
            for token_id in set(ids):
                scores[row, token_id] -= self.presence + self.frequency * ids.count(token_id)
            for token_id, value in self.bias.items():
                scores[row, token_id] += value
        return scores


def engine_greedy(engine: Engine, params: SamplingParams) -> list[list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    got = run_to_completion(engine)
    return [got[f"r{i}"] for i in range(len(PROMPTS))]


def greedy(**fields) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **fields)


def test_repetition_penalty_equals_transformers(make_tiny, hf) -> None:
    plain = engine_greedy(make_tiny(), greedy())
    got = engine_greedy(make_tiny(max_num_batched_tokens=16), greedy(repetition_penalty=1.5))
    assert got == [greedy_continuation(hf, p, NEW_TOKENS, repetition_penalty=1.5) for p in PROMPTS]
    assert got != plain  # the tiny model repeats itself; the penalty changes that
    assert max(len(set(g)) for g in got) > max(len(set(p)) for p in plain)


def test_presence_frequency_and_logit_bias_equal_an_openai_processor(make_tiny, hf) -> None:
    bias = {11: 2.0, 12: -100.0}
    params = greedy(presence_penalty=1.5, frequency_penalty=0.5, logit_bias=bias)
    got = engine_greedy(make_tiny(), params)
    want = [
        greedy_continuation(
            hf, p, NEW_TOKENS, logits_processor=[OpenAIPenalties(len(p), 1.5, 0.5, bias)]
        )
        for p in PROMPTS
    ]
    assert got == want
    assert got != engine_greedy(make_tiny(), greedy())
    assert all(12 not in g for g in got)


def test_top_logprobs_equal_transformers_log_softmax(make_tiny, hf) -> None:
    llm = LLM(engine=make_tiny())
    outs = llm.generate(PROMPTS, greedy(logprobs=True, top_logprobs=5))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt + out.token_ids])
        with torch.inference_mode():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).topk(5, -1)
        assert len(out.top_logprobs) == len(out.token_ids) == NEW_TOKENS
        for i, top in enumerate(out.top_logprobs):
            assert [t for t, _ in top] == want.indices[i].tolist()
            torch.testing.assert_close(
                torch.tensor([lp for _, lp in top]), want.values[i], atol=1e-4, rtol=0
            )
            assert top[0] == (out.token_ids[i], pytest.approx(out.logprobs[i]))


def test_overlapped_steps_do_not_run_ahead_of_penalised_requests(make_tiny) -> None:
    params = greedy(presence_penalty=2.0, repetition_penalty=1.2)
    want = engine_greedy(make_tiny(), params)
    overlapped = make_tiny(async_scheduling=True)
    assert engine_greedy(overlapped, params) == want
    assert overlapped.stats.num_steps_ahead == 0
    engine_greedy(overlapped, greedy())
    assert overlapped.stats.num_steps_ahead > 0  # it does run ahead of unpenalised ones


def test_a_split_prefill_and_a_migrated_leg_count_output_tokens_alike(make_tiny) -> None:
    """The decode role continues what the prefill role sampled first; a leg that resumes with
    the sent tokens as prompt (num_resumed_tokens) goes on exactly as if never interrupted."""
    params = greedy(presence_penalty=2.0, frequency_penalty=1.0)
    prompt = PROMPTS[0]
    engine = make_tiny()
    whole = engine_greedy(engine, params)[0]
    prefill = make_tiny()
    prefill.add_request("p", prompt, params, keep_blocks=True)
    (first,) = run_to_completion(prefill)["p"]
    prefill.release_blocks("p")
    decode = make_tiny()
    assert decode.add_prefilled_request("p", prompt, first, params) is not None
    decode.fail_kv("p")  # no transfer here: the decode engine recomputes the prompt
    assert [first, *run_to_completion(decode)["p"]] == whole
    sent = whole[:6]
    resumed = SamplingParams(**{**params.__dict__, "max_tokens": NEW_TOKENS - len(sent)})
    engine.add_request("m", prompt + sent, resumed, num_resumed_tokens=len(sent))
    assert run_to_completion(engine)["m"] == whole[len(sent) :]
