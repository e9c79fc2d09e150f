"""Scheduler + KVCacheManager without a model: budgets, chunking, preemption, fairness."""

from __future__ import annotations

from engine.config import SchedulerConfig
from engine.kv_cache.manager import KVCacheManager
from engine.sampling.sampling_params import SamplingParams
from engine.step.request import FinishReason, Request
from engine.step.scheduler import Scheduler


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_seqs=8, max_len=256):
    kv = KVCacheManager(num_blocks, block_size, "m")
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    return Scheduler(config, kv, max_len)


def make_request(
    req_id: str, num_prompt: int, max_tokens: int = 4, first: int = 0, keep_blocks: bool = False
) -> Request:
    tokens = [(first + i) % 1000 for i in range(num_prompt)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(req_id, tokens, params, keep_blocks=keep_blocks)


def run_step(sched: Scheduler, token: int = 7):
    """One fake step: every sampling chunk yields `token`; requests stop at max_tokens."""
    out = sched.schedule()
    sched.update(out)
    for chunk in out.chunks:
        if chunk.samples:
            chunk.req.append_token(token)
            if chunk.req.num_output_tokens >= chunk.req.sampling.max_tokens:
                sched.finish(chunk.req, FinishReason.LENGTH)
    sched.kv.check_integrity()
    return out


def test_chunked_prefill_respects_budget_and_mixes_decodes():
    sched = make_scheduler(budget=32)
    sched.add(make_request("short", 3, max_tokens=10))
    run_step(sched)
    sched.add(make_request("long", 100))
    sizes = []
    while "long" in sched.requests and sched.requests["long"].num_output_tokens == 0:
        out = run_step(sched)
        assert out.num_batched_tokens <= 32
        by_id = {c.req.req_id: c.num_new_tokens for c in out.chunks}
        assert by_id.get("short") == 1, "the running decode goes first every step"
        sizes.append(by_id["long"])
    assert sizes == [31, 31, 31, 7]


def test_max_num_seqs_limits_running_batch():
    sched = make_scheduler(max_seqs=2)
    for i in range(4):
        sched.add(make_request(f"r{i}", 4))
    out = run_step(sched)
    assert len(out.chunks) == 2 and len(sched.waiting) == 2


def test_preemption_by_recompute_finishes_everyone_fcfs():
    # 6 blocks x 4 tokens: two requests of 8 prompt tokens growing by 12 cannot both fit.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    sched.add(make_request("a", 8, max_tokens=12, first=0))
    sched.add(make_request("b", 8, max_tokens=12, first=500))
    finished_order = []
    for _ in range(200):
        if not sched.has_unfinished:
            break
        live = set(sched.requests)
        run_step(sched)
        finished_order += sorted(live - set(sched.requests))
    assert finished_order == ["a", "b"], "the earlier request is never starved"
    assert sched.num_preemptions > 0
    assert sched.kv.num_free_blocks == 6


def test_lone_request_as_large_as_pool_completes():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=8, max_len=16)
    sched.add(make_request("big", 12, max_tokens=4))
    for _ in range(50):
        if not sched.has_unfinished:
            break
        run_step(sched)
    assert not sched.has_unfinished and sched.kv.num_free_blocks == 4


def test_prefix_match_reuses_blocks_but_leaves_last_token():
    sched = make_scheduler(block_size=4)
    sched.add(make_request("a", 8, max_tokens=1))
    run_step(sched)
    req = make_request("b", 8, max_tokens=1)
    match = sched.kv.match_prefix(req)
    assert match.num_tokens == 4, "an exact repeat still computes its last block"
    longer = make_request("c", 13, max_tokens=1)
    assert sched.kv.match_prefix(longer).num_tokens == 8


def test_abort_of_waiting_and_running_frees_blocks():
    sched = make_scheduler(budget=4)
    sched.add(make_request("a", 10))
    sched.add(make_request("b", 10))
    run_step(sched)
    sched.finish(sched.requests["a"], FinishReason.ABORT)
    sched.finish(sched.requests["b"], FinishReason.ABORT)
    assert not sched.has_unfinished
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_partial_reuse_fits_a_full_pool():
    """The prompt needs every block of the pool, its partial copy's source included: the copy
    is queued before that block is taken again, so the prompt is admitted with the reuse."""
    kv = KVCacheManager(3, 4, "m", partial_reuse_min_tokens=1)
    config = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8)
    sched = Scheduler(config, kv, 64)
    first = Request("a", list(range(1, 9)), SamplingParams(max_tokens=1, temperature=0))
    sched.add(first)
    run_step(sched)
    assert first.is_finished
    second = Request("b", [1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 0], SamplingParams(max_tokens=1))
    sched.add(second)
    out = sched.schedule()
    assert [c.req.req_id for c in out.chunks] == ["b"]
    assert second.num_cached_tokens == 6
    assert [c.kind for c in kv.owed.drain_copies()] == ["device"]


def test_step_run_ahead_leaves_out_what_ends_and_preempts_nothing_while_it_does():
    """Two running decodes fill the pool: "ends" has its last token in flight (pending),
    "grows" needs a new block for its next token. In the step scheduled ahead "ends" is left
    out (nothing to compute), "grows" waits a step instead of preempting, and nothing waiting
    is admitted; once "ends" finishes, "grows" and "waits" share its blocks."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    sched.add(make_request("ends", 7, max_tokens=2))  # 2 blocks; its 2nd token ends it
    sched.add(make_request("grows", 8, max_tokens=10, first=500))  # 2 full blocks
    run_step(sched)  # both prefilled, one token each
    sched.add(make_request("waits", 4, first=900))
    ends, grows = sched.requests["ends"], sched.requests["grows"]
    assert sched.kv.num_free_blocks == 0 and grows.num_tokens == 9
    for req in (ends, grows):
        req.num_pending_tokens += 1  # the engine's step in flight samples their next tokens
    assert sched.ends_with_pending(ends) and not sched.ends_with_pending(grows)
    ahead = sched.schedule()
    assert ahead.chunks == [] and ahead.preempted_req_ids == []
    assert [r.req_id for r in sched.running] == ["ends", "grows"] and len(sched.waiting) == 1
    for req in (ends, grows):  # the step's tokens arrive
        req.num_pending_tokens -= 1
        req.append_token(7)
    sched.finish(ends, FinishReason.LENGTH)
    out = sched.schedule()
    assert {c.req.req_id: c.num_new_tokens for c in out.chunks} == {"grows": 2, "waits": 4}
    assert out.preempted_req_ids == []
    sched.kv.check_integrity()


def test_a_held_request_ends_with_its_pending_first_token():
    """A keep_blocks request (the prefill role's) finishes with its first token whatever
    max_tokens says, so with that token in flight the step scheduled ahead leaves it out (no
    decode row writes into the blocks about to be kept) while the other request keeps
    prefilling."""
    sched = make_scheduler(budget=8)
    held = make_request("held", 6, max_tokens=50, keep_blocks=True)
    sched.add(held)
    sched.add(make_request("next", 12, first=300))
    out = sched.schedule()  # held's whole prompt (it samples) and 2 tokens of next's
    sched.update(out)
    assert [(c.req.req_id, c.num_new_tokens, c.samples) for c in out.chunks] == [
        ("held", 6, True),
        ("next", 2, False),
    ]
    assert not sched.ends_with_pending(held)
    held.num_pending_tokens += 1  # the step in flight samples its first token
    assert sched.ends_with_pending(held)
    ahead = sched.schedule()
    assert [(c.req.req_id, c.num_new_tokens) for c in ahead.chunks] == [("next", 8)]
    assert ahead.preempted_req_ids == [] and held.num_computed_tokens == 6
    held.num_pending_tokens -= 1
    held.append_token(7)
    kept = sched.finish(held, FinishReason.FIRST_TOKEN)
    assert kept is not None and kept.block_ids  # its blocks, kept for the caller
    sched.update(ahead)
    assert sched.kv.release_kept("held")
    sched.kv.check_integrity()


def test_the_step_run_ahead_never_preempts_a_held_request_about_to_be_leased():
    """The pool is full and "grows" needs a new block for its pending token; the newest
    running request, the preemption victim, is a keep_blocks one whose first token is in
    flight. Preempting it would keep empty blocks: the step run ahead leaves "grows" out
    instead."""
    sched = make_scheduler(num_blocks=4, block_size=4, budget=32)
    sched.add(make_request("grows", 8, max_tokens=10, first=500))  # 2 full blocks
    held = make_request("held", 7, max_tokens=50, keep_blocks=True)  # 2 blocks
    sched.add(held)
    sched.update(sched.schedule())  # both prompts computed; both sample
    grows = sched.requests["grows"]
    assert sched.kv.num_free_blocks == 0
    for req in (grows, held):
        req.num_pending_tokens += 1  # the step in flight samples their next tokens
    ahead = sched.schedule()
    assert ahead.chunks == [] and ahead.preempted_req_ids == []
    assert [r.req_id for r in sched.running] == ["grows", "held"]
    for req in (grows, held):  # the step's tokens arrive; held leaves the batch, leased
        req.num_pending_tokens -= 1
        req.append_token(7)
    kept = sched.finish(held, FinishReason.FIRST_TOKEN)
    assert kept is not None and kept.block_ids
    assert sched.kv.release_kept("held")  # the decode side has read its blocks
    out = sched.schedule()
    assert [(c.req.req_id, c.num_new_tokens) for c in out.chunks] == [("grows", 1)]
    assert out.preempted_req_ids == []
    sched.kv.check_integrity()
