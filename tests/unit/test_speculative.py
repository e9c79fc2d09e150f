"""ngram_draft and Speculator's acceptance and eligibility rules (pure Python)."""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.sampling.sampling_params import SamplingParams, StructuredOutput
from engine.speculation.speculative import Speculator, ngram_draft
from engine.step.request import Request


def test_ngram_draft_continues_the_latest_longest_match_with_room():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 2, 3]
    # "2 3" last occurred at 6..7 (followed by 5 6 7); the 3-gram "7 2 3" never did before
    assert ngram_draft(tokens, 3, n_min=2, n_max=3) == [5, 6, 7]
    # 10 tokens: only the occurrence at 1..2 has that many after it
    assert ngram_draft(tokens, 10, n_min=2, n_max=3) == [4, 9, 1, 2, 3, 5, 6, 7, 2, 3]
    assert ngram_draft(tokens, 12, n_min=2, n_max=3) == [4, 9, 1, 2, 3, 5, 6, 7, 2, 3]
    assert ngram_draft([5, 6, 1, 2, 3, 7, 8, 1, 2, 3], 2, 1, 3) == [7, 8]  # 3-gram first


def test_ngram_draft_finds_nothing_without_a_repeat():
    assert ngram_draft([1, 2, 3, 4], 4, n_min=1, n_max=3) == []
    assert ngram_draft([1], 4, n_min=1, n_max=3) == []
    assert ngram_draft([4, 4], 4, n_min=1, n_max=1) == [4]


def running(params: SamplingParams, tokens: list[int]) -> Request:
    req = Request("r", tokens, params)
    req.num_computed_tokens = len(tokens) - 1
    return req


def test_accept_keeps_the_matching_drafts_then_the_first_differing_token():
    spec = Speculator(SpeculativeConfig(method="ngram"), 100, kv=None)  # type: ignore[arg-type]
    req = running(SamplingParams(), [1, 2])
    assert spec.accept(req, [5, 6, 7], [5, 6, 9, 4]) == [5, 6, 9]
    assert spec.accept(req, [5, 6], [5, 6, 8]) == [5, 6, 8]  # all accepted: the bonus token
    assert spec.accept(req, [5], [3, 4]) == [3]
    assert (spec.num_drafted_tokens, spec.num_accepted_tokens, spec.num_verify_steps) == (6, 4, 3)
    assert (req.num_drafted_tokens, req.num_accepted_tokens) == (6, 4)


def test_propose_leaves_room_for_max_tokens_and_skips_what_cannot_speculate():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1)
    spec = Speculator(config, max_model_len=100, kv=None)  # type: ignore[arg-type]
    loop = [7, 8] * 5 + [7]
    near_end = running(SamplingParams(max_tokens=3), loop)
    near_end.output_token_ids = [8]  # 1 of 3 out: drafts for 1 more besides the next token
    penalised = running(SamplingParams(repetition_penalty=1.2), loop)
    grammar = running(SamplingParams(structured=StructuredOutput("json_object")), loop)
    opted_out = running(SamplingParams(speculative=False), loop)
    free = running(SamplingParams(), loop)
    spec.propose([near_end, penalised, grammar, opted_out, free])
    assert near_end.draft_token_ids == [8]
    assert penalised.draft_token_ids == grammar.draft_token_ids == opted_out.draft_token_ids == []
    assert free.draft_token_ids == [8, 7, 8, 7]


def test_speculation_is_off_above_max_batch():
    spec = Speculator(SpeculativeConfig(method="ngram", max_batch=2), 100, kv=None)  # type: ignore[arg-type]
    req = running(SamplingParams(), [1, 1, 1])
    assert spec.wants(req, 2) and not spec.wants(req, 3)
    assert not Speculator(SpeculativeConfig(), 100, kv=None).wants(req, 1)  # type: ignore[arg-type]


def test_a_request_that_keeps_missing_drafts_less_often():
    """No draft found (or none accepted) pauses drafting for 2, 4, 8 ... tokens, in which the
    request decodes plainly (so it runs ahead); a draft accepted ends the streak."""
    spec = Speculator(SpeculativeConfig(method="ngram", ngram_min=1), 100, kv=None)  # type: ignore[arg-type]
    req = running(SamplingParams(), [1, 2, 3])
    spec.propose([req])
    assert req.draft_token_ids == [] and not spec.wants(req, 1)
    assert (req.num_draft_misses, req.draft_again_at) == (1, 5)
    req.append_token(4)  # two tokens later (plain decodes) it tries again
    req.append_token(5)
    req.num_computed_tokens = req.num_tokens - 1
    assert spec.wants(req, 1)
    spec.propose([req])
    assert (req.num_draft_misses, req.draft_again_at) == (2, 9)
    assert spec.accept(req, [6, 7], [3, 3, 3]) == [3]  # drafted, none accepted: a miss too
    assert req.num_draft_misses == 3
    assert spec.accept(req, [6, 7], [6, 3, 3]) == [6, 3]
    assert req.num_draft_misses == 0
    for _ in range(10):
        spec._missed(req)
    assert req.draft_again_at == req.num_tokens + 32  # the pause stops growing


def test_drafts_shrink_to_fit_the_largest_decode_graph():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, max_batch=64)
    spec = Speculator(config, 100, kv=None, max_rows=12)  # type: ignore[arg-type]
    assert [spec.drafts_per_request(n) for n in (1, 2, 3, 6, 7)] == [4, 4, 3, 1, 0]
    reqs = [running(SamplingParams(), [7, 8] * 5 + [7]) for _ in range(3)]
    spec.propose(reqs)
    assert [r.draft_token_ids for r in reqs] == [[8, 7, 8]] * 3  # 3 x (1 + 3) rows = 12
    assert not spec.wants(reqs[0], 7)  # 7 rows leave no room for a draft: decode plainly
