"""Overlapped steps (async_scheduling): the next step is scheduled and queued before the
previous step's tokens are read. On CPU nothing overlaps in time, but every bookkeeping path is
the one the GPU runs, so outputs must equal the plain engine's token for token."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.execution.runner import StepLogits
from engine.execution.step_inputs import TokenFill
from engine.sampling.sampling_params import SamplingParams
from engine.step.request import Request
from engine.step.scheduler import SchedulerOutput
from engine.step.step_rate import StepRate
from tests.conftest import run_to_completion


def workload(tokenizer) -> dict[str, tuple[list[int], SamplingParams]]:
    prompts = [
        "The capital of France is",
        "Write a haiku about the sea:",
        "def fibonacci(n):",
        "List three colours: red,",
        "Once upon a time, in a small village,",
    ]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0, logprobs=True, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.7, seed=3, top_k=20, ignore_eos=True),
    ]
    return {
        f"r{i}": (tokenizer.encode(p), sp)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    }


def run(
    engine, requests, after_step: Callable[[list[Request]], None] | None = None
) -> tuple[dict[str, list[int]], dict[str, str | None], dict]:
    """Run to completion; after_step(the requests) is called between steps."""
    live = [engine.add_request(r, prompt, params) for r, (prompt, params) in requests.items()]
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    reasons: dict[str, str | None] = {}
    logprobs: dict[str, list[float]] = {r: [] for r in requests}
    while engine.has_unfinished_requests:
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
            logprobs[out.req_id].extend(out.new_logprobs or [])
            if out.finished:
                reasons[out.req_id] = out.finish_reason
        if after_step is not None:
            after_step(live)
    return tokens, reasons, logprobs


def test_overlapped_steps_equal_plain_steps(make_engine, tokenizer):
    requests = workload(tokenizer)
    plain = make_engine(max_num_batched_tokens=16)  # chunked prefills next to decodes
    want_tokens, want_reasons, want_logprobs = run(plain, requests)
    # A stop token met mid-run: r3 must stop where the plain engine's output first has it.
    stop_token = want_tokens["r3"][5]
    requests["r3"] = (
        requests["r3"][0],
        SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(stop_token,)),
    )
    plain_stop = make_engine(max_num_batched_tokens=16)
    want_tokens, want_reasons, want_logprobs = run(plain_stop, requests)
    assert want_reasons["r3"] == "stop" and len(want_tokens["r3"]) < 16

    overlapped = make_engine(max_num_batched_tokens=16, async_scheduling=True)
    assert overlapped.overlap_steps and not plain.overlap_steps
    got_tokens, got_reasons, got_logprobs = run(overlapped, requests)
    assert got_tokens == want_tokens
    assert got_reasons == want_reasons
    assert got_logprobs["r2"] == want_logprobs["r2"] and len(got_logprobs["r2"]) == 9
    assert overlapped.stats.num_steps_ahead > 10  # it did run ahead, most decode steps
    assert overlapped.stats.num_generated_tokens == sum(map(len, want_tokens.values()))
    overlapped.check_integrity()


def test_abort_while_a_step_runs_ahead(make_engine, tokenizer):
    requests = workload(tokenizer)
    greedy = {r: v for r, v in requests.items() if v[1].temperature == 0}
    want = run(make_engine(), greedy)[0]
    engine = make_engine(async_scheduling=True)
    for req_id, (prompt, params) in greedy.items():
        engine.add_request(req_id, prompt, params)
    got: dict[str, list[int]] = {r: [] for r in greedy}
    for _ in range(4):
        for out in engine.step():
            got[out.req_id].extend(out.new_token_ids)
    assert engine.run_ahead.in_flight is not None  # a step is queued ahead of what step() returned
    assert engine.abort("r0")
    engine.check_integrity()
    for req_id, tokens in run_to_completion(engine).items():
        got[req_id].extend(tokens)
    assert "r0" not in engine.scheduler.requests
    assert got["r0"] == want["r0"][: len(got["r0"])] and len(got["r0"]) < len(want["r0"])
    for req_id in ("r2", "r3"):
        assert got[req_id] == want[req_id]


def test_token_lists_hold_only_real_tokens_while_running_ahead(make_engine, tokenizer):
    """A token sampled by a step still in flight is pending (counted, with its id on the
    device), never a fake id in the request's token list: checked at every launch, every
    prefix-cache update and after every step, while outputs stay the plain engine's."""
    requests = workload(tokenizer)
    want = run(make_engine(max_num_batched_tokens=16), requests)
    engine = make_engine(max_num_batched_tokens=16, async_scheduling=True)
    vocab = engine.model_config.vocab_size
    num_pending_seen = 0

    def check(req: Request) -> None:
        assert len(req.all_token_ids) == req.num_prompt_tokens + req.num_output_tokens
        assert all(isinstance(t, int) and 0 <= t < vocab for t in req.all_token_ids)
        assert req.num_pending_tokens in (0, 1)
        assert req.num_tokens == len(req.all_token_ids) + req.num_pending_tokens

    execute = engine.runner.execute

    def checking_execute(output: SchedulerOutput, fill: TokenFill | None = None) -> StepLogits:
        nonlocal num_pending_seen
        for chunk in output.chunks:
            check(chunk.req)
            num_pending_seen += chunk.req.num_pending_tokens
        return execute(output, fill)

    cache_full_blocks = engine.kv.cache_full_blocks

    def checking_cache_full_blocks(req: Request) -> None:
        check(req)
        assert req.num_computed_tokens <= len(req.all_token_ids)  # no pending one gets hashed
        cache_full_blocks(req)
        assert len(req.block_hashes) <= len(req.all_token_ids) // engine.kv.block_size

    engine.runner.execute = checking_execute
    engine.kv.cache_full_blocks = checking_cache_full_blocks

    def between_steps(live: list[Request]) -> None:
        for req in live:  # between steps no token is pending
            check(req)
            assert req.num_pending_tokens == 0

    tokens, reasons, logprobs = run(engine, requests, between_steps)
    assert (tokens, reasons, logprobs) == want
    assert num_pending_seen > 10 and engine.stats.num_steps_ahead > 10
    engine.check_integrity()


def test_requests_that_end_by_length_do_not_stop_running_ahead(make_engine, tokenizer):
    """A request whose pending token reaches max_tokens (or max_model_len) is left out of the
    step launched ahead instead of holding that step back: every step but the first runs
    ahead, outputs equal the plain engine's, the lengths are exact and no block leaks."""
    requests = {
        r: (prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for (r, (prompt, _)), n in zip(workload(tokenizer).items(), [3, 7, 8, 11, 200], strict=True)
    }
    max_model_len = len(requests["r4"][0]) + 13  # r4 ends by the model length, not max_tokens
    want_tokens, want_reasons, _ = run(make_engine(max_model_len=max_model_len), requests)
    engine = make_engine(max_model_len=max_model_len, async_scheduling=True)
    got_tokens, got_reasons, _ = run(engine, requests)
    assert got_tokens == want_tokens and got_reasons == want_reasons
    assert [len(t) for t in got_tokens.values()] == [3, 7, 8, 11, 13]
    assert set(got_reasons.values()) == {"length"}
    assert engine.stats.num_steps_ahead == engine.stats.num_steps - 1
    engine.check_integrity()


def test_the_prefill_role_runs_ahead_and_leases_the_same_kv(make_engine, tokenizer):
    """A held request (prefill role) ends with its first token, so the step run ahead leaves it
    out instead of waiting for it, and a step where nothing samples (a long prompt's middle
    chunk) runs ahead too. First tokens, finish reasons and the leased blocks' KV (unused
    slots included: no step wrote past a prompt) equal the plain engine's, and nothing is left
    once the leases are released."""
    texts = [
        "The history of the printing press begins " * 6,
        "def fibonacci(n):",
        "List three colours: red,",
        "Once upon a time, in a small village, " * 3,
    ]
    prompts = {f"p{i}": tokenizer.encode(text) for i, text in enumerate(texts)}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def prefill_all(
        engine, params: SamplingParams = params
    ) -> dict[str, tuple[list[int], str | None, torch.Tensor]]:
        for req_id, prompt in prompts.items():
            engine.add_request(req_id, prompt, params, keep_blocks=True)
        outs = {}
        while engine.has_unfinished_requests:
            outs.update({out.req_id: out for out in engine.step()})
        assert all(out.finished and out.kept_block_ids for out in outs.values())
        leased = {
            r: (out.new_token_ids, out.finish_reason, engine.kv_cache[list(out.kept_block_ids)])
            for r, out in outs.items()
        }
        assert len(engine.kv.kept) == len(prompts)
        for req_id in prompts:
            assert engine.release_blocks(req_id)
        return leased

    want = prefill_all(make_engine(max_num_batched_tokens=16))
    engine = make_engine(max_num_batched_tokens=16, async_scheduling=True)
    got = prefill_all(engine)
    assert engine.overlap_steps and engine.stats.num_steps > len(prompts)
    # Run ahead of: p0's first chunk (nothing samples), p0's last chunk beside p1's first (p0
    # samples its leased token), p1 and p2 ending beside p3's first chunk. Waiting for every
    # held request, as the engine did before, runs ahead of none.
    assert engine.stats.num_steps_ahead >= 3
    assert {r: leased[:2] for r, leased in got.items()} == {r: w[:2] for r, w in want.items()}
    assert {reason for _, reason, _ in got.values()} == {"first_token"}
    for req_id, (_, _, kv) in got.items():
        assert torch.equal(kv, want[req_id][2]), req_id
    engine.check_integrity()

    # With host leases a lease waits for its host copies, and a parent with n > 1 choices
    # forks them from its logits after the step: either would queue behind a step run ahead,
    # so only the steps where nothing samples (p0's first chunk, p3's middle one) run ahead of
    # others there.
    block_bytes = engine.kv_cache[0].numel() * engine.kv_cache.element_size()
    tiered = make_engine(
        max_num_batched_tokens=16,
        async_scheduling=True,
        host_kv_cache_bytes=16 * block_bytes,
        keep_on_host=True,
    )
    assert tiered.kv.keep_on_host
    got = prefill_all(tiered)
    assert {r: leased[:2] for r, leased in got.items()} == {r: w[:2] for r, w in want.items()}
    assert tiered.stats.num_steps_ahead == 2
    tiered.check_integrity()
    forking = make_engine(max_num_batched_tokens=16, async_scheduling=True)
    got = prefill_all(forking, SamplingParams(n=2, max_tokens=8, temperature=0, ignore_eos=True))
    assert {r: leased[0] for r, leased in got.items()} == {r: w[0] for r, w in want.items()}
    assert forking.stats.num_steps_ahead == 2
    forking.check_integrity()


class RecordedRate(StepRate):
    """A StepRate that also keeps the token count of each step recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []

    def record(self, seconds: float, num_tokens: int) -> None:
        assert seconds > 0
        self.tokens.append(num_tokens)
        super().record(seconds, num_tokens)


@pytest.mark.parametrize("overlap", [False, True])
def test_each_step_is_timed_with_its_own_tokens(make_engine, tokenizer, overlap):
    """The step rates (the prompt rate the read gate and the router's TTFT predictions use, the
    slow-step log, the speculation guard) pair a step's wall time with that step's tokens. With
    overlapped steps a step() call waits for one step and launches the next; the rates got the
    next step's tokens (a prompt step's time against one decode token: a prompt rate ~100x
    too slow on a GPU, where steps run ahead)."""
    prompt = tokenizer.encode("The history of the printing press begins " * 12)
    assert len(prompt) >= 64  # a prefill step: PREFILL_STEP_TOKENS
    engine = make_engine(max_num_batched_tokens=512, async_scheduling=overlap)
    engine.stats.rate = rate = RecordedRate()
    engine.stats.prefill_rate = prefill = RecordedRate()
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    run_to_completion(engine)
    assert engine.overlap_steps == overlap
    assert prefill.tokens == [len(prompt)]
    assert rate.tokens == [len(prompt)] + [1] * 5  # the first token is the prompt step's
    assert engine.stats.last_step_s > 0


def test_a_step_whose_requests_were_all_aborted_is_not_timed(make_engine, tokenizer):
    """A step run ahead of a request that is then aborted stays in flight while the engine
    idles; read when the next request comes, its time would hold that idle time (it made a 3 s
    'step' of one token, which the routers' TPOT rule then read): RunAhead drops it unread."""
    engine = make_engine(max_num_batched_tokens=512, async_scheduling=True)
    engine.stats.rate = rate = RecordedRate()
    a = tokenizer.encode("The history of the printing press begins " * 12)
    b = tokenizer.encode("Once upon a time, in a small village, " * 10)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.add_request("a", a, params)
    engine.step()
    engine.step()  # a's first decode read, its second in flight
    engine.abort("a")
    assert not engine.has_unfinished_requests
    engine.add_request("b", b, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    run_to_completion(engine)
    assert rate.tokens == [len(a), 1, len(b), 1, 1]  # a's aborted decode step not among them
