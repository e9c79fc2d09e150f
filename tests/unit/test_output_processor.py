"""OutputProcessor without a model: a step's sampled tokens become outputs, what stops is
finished and freed, a request's decoding state lives on it from start to release, and an n > 1
request's choices fork off its prompt logits."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from engine.config import SchedulerConfig, SpeculativeConfig
from engine.kv_cache.manager import KVCacheManager
from engine.sampling.sampler import PendingSample, Sampler
from engine.sampling.sampling_params import SamplingParams, StructuredOutput
from engine.sampling.validation import InvalidField
from engine.speculation.speculative import Speculator
from engine.step.fork import ChoiceForks
from engine.step.output_processor import OutputProcessor
from engine.step.request import FinishReason, Request
from engine.step.scheduler import Scheduler
from engine.step.step_types import InFlightStep

EOS = 15
VOCAB = 16


class LetterDecoder:
    """Token i decodes to the i-th lowercase letter."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids)


def make_processor(tokenizer: LetterDecoder | None = None) -> OutputProcessor:
    kv = KVCacheManager(64, 4, "m")
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, 128)
    forks = ChoiceForks(scheduler, kv)
    speculator = Speculator(SpeculativeConfig(), 128, kv)
    sampler = Sampler(torch.device("cpu"), seed=0)
    return OutputProcessor(scheduler, forks, speculator, sampler, tokenizer, {EOS}, None, False)


def queue(out: OutputProcessor, req_id: str, **params: object) -> Request:
    req = Request(req_id, [5, 6, 7, 8, 9], SamplingParams(temperature=0, **params))  # type: ignore[arg-type]
    out.start(req)
    out.scheduler.add(req)
    return req


def step_sampling(out: OutputProcessor, token_ids: list[int]) -> InFlightStep:
    """Schedule a step whose rows sampled token_ids (in row order)."""
    scheduled = out.scheduler.schedule()
    out.scheduler.update(scheduled)
    reqs = [chunk.req for chunk in scheduled.chunks if chunk.samples]
    assert len(reqs) == len(token_ids)
    return InFlightStep(scheduled, reqs, PendingSample(torch.tensor(token_ids), None), False)


def test_tokens_are_appended_and_eos_and_max_tokens_finish_and_free() -> None:
    out = make_processor()
    eos, short, going = queue(out, "eos"), queue(out, "short", max_tokens=1), queue(out, "going")
    outputs = out.process(step_sampling(out, [EOS, 3, 4]))
    by_id = {o.req_id: o for o in outputs}
    assert [o.new_token_ids for o in outputs] == [[EOS], [3], [4]]
    assert by_id["eos"].finish_reason == "stop" and eos.stop_reason == EOS
    assert by_id["short"].finish_reason == "length" and short.finish_reason is FinishReason.LENGTH
    assert not by_id["going"].finished and going.output_token_ids == [4]
    assert by_id["going"].num_cached_tokens == 0  # admitted with no prefix cached
    assert set(out.scheduler.requests) == {"going"}
    out.scheduler.finish(going, FinishReason.ABORT)
    out.kv.assert_all_free()


def test_stop_token_ids_stop_the_request_and_are_looked_up_in_a_set() -> None:
    out = make_processor()
    listed, other = queue(out, "listed", stop_token_ids=[2, 9, 2]), queue(out, "other")
    assert listed.stop_token_ids == frozenset({2, 9})  # built once, not scanned per token
    outputs = out.process(step_sampling(out, [9, 9]))
    assert outputs[0].finish_reason == "stop" and listed.stop_reason == 9
    assert not outputs[1].finished  # 9 is not the other request's stop token
    out.scheduler.finish(other, FinishReason.ABORT)
    out.kv.assert_all_free()


def test_a_stop_string_ends_the_request_and_its_text_is_cut_before_it() -> None:
    out = make_processor(LetterDecoder())
    req = queue(out, "r", stop=("cd",))
    assert req.stop_checker is not None
    texts = [out.process(step_sampling(out, [t]))[0] for t in (1, 2, 3)]  # "b", "c", "d"
    assert "".join(o.new_text for o in texts) == "b"
    assert texts[-1].finish_reason == "stop" and req.stop_reason == "cd"
    assert req.stop_checker is None  # released with the request
    out.kv.assert_all_free()


def test_a_seeded_request_owns_its_generator_until_released() -> None:
    out = make_processor()
    req = queue(out, "r", seed=7)
    assert isinstance(req.generator, torch.Generator)
    assert queue(out, "unseeded").generator is None
    out.release(req)
    assert req.generator is None and req.stop_checker is None


def test_a_grammar_without_a_tokenizer_is_refused_at_start() -> None:
    out = make_processor()
    spec = StructuredOutput("json_object", "")
    req = Request("r", [5, 6], SamplingParams(structured=spec))
    with pytest.raises(InvalidField, match="tokenizer"):
        out.start(req)


def test_choices_fork_off_the_prompt_logits_before_the_parent_token() -> None:
    out = make_processor()
    parent = queue(out, "p", n=3, max_tokens=2)
    step = step_sampling(out, [4])
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 11] = 5.0  # greedy choices draw 11
    step.fork_logits["p"] = logits
    outputs = out.process(step)
    assert [(o.req_id, o.index, o.new_token_ids) for o in outputs] == [
        ("p", 1, [11]),
        ("p", 2, [11]),
        ("p", 0, [4]),
    ]
    assert out.forks.live_choices("p") == ["p#1", "p#2"]
    assert all(out.scheduler.requests[f"p#{i}"].num_output_tokens == 1 for i in (1, 2))
    assert parent.num_output_tokens == 1
