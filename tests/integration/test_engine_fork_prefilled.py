"""n > 1 across the pools, engine by engine: the prefill engine computes the prompt once and
samples every choice's first token under one lease; the decode engine loads that KV once and
forks the choices that go on (engine/step/fork.py first_token_choices / fork_prefilled)."""

from __future__ import annotations

from dataclasses import replace

from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams
from engine.step.request import PrefilledChoices
from engine.step.step_types import RequestOutput
from tests.conftest import EngineFactory
from tests.integration.test_engine_fork import PROMPT, run_choices

MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def prefill(engine: Engine, req_id: str, prompt: list[int], params: SamplingParams):
    """Run a hold_kv request to its first tokens: (outputs by choice index, computed tokens)."""
    before = engine.stats.num_computed_tokens
    engine.add_request(req_id, prompt, params, keep_blocks=True)
    outputs: dict[int, RequestOutput] = {}
    while engine.has_unfinished_requests:
        outputs.update((out.index, out) for out in engine.step())
    return outputs, engine.stats.num_computed_tokens - before


def hand_over(
    source: Engine, target: Engine, req_id: str, prompt: list[int], params: SamplingParams,
    outputs: dict[int, RequestOutput], fail: bool = False,
) -> None:  # fmt: skip
    """What the decode worker does with a KVHandle: reserve, copy the blocks (the NIXL read),
    commit (or fail: recompute), then the prefill side's lease is released."""
    first = outputs[0]
    going_on = {i: out.new_token_ids[0] for i, out in outputs.items() if i and out_goes_on(out)}
    reason = None if out_goes_on(first) else first.finish_reason
    choices = PrefilledChoices(going_on, reason)
    plan = target.add_prefilled_request(
        req_id, prompt, first.new_token_ids[0], params, choices=choices
    )
    assert plan is not None
    remote = first.kept_block_ids[plan.first_block : plan.first_block + len(plan.local_block_ids)]
    for src, dst in zip(remote, plan.local_block_ids, strict=True):
        target.kv_cache[dst].copy_(source.kv_cache[src])
    (target.fail_kv if fail else target.commit_kv)(req_id)
    assert source.release_blocks(req_id)


def out_goes_on(out: RequestOutput) -> bool:
    return out.finish_reason == "first_token"


def test_prefill_samples_n_first_tokens_under_one_lease_and_decode_forks_them(
    make_engine: EngineFactory,
) -> None:
    source, target = make_engine(), make_engine()
    prompt = source.tokenize_prompt(PROMPT)
    assert len(prompt) % source.kv.block_size, "the test wants a partial last block"
    target.add_request("ref", prompt, GREEDY)
    single = run_choices(target)[("ref", 0)]
    target.kv.pool.evict_all_cached()  # the decode side finds nothing of the prompt itself

    params = replace(GREEDY, n=3)
    outputs, computed = prefill(source, "r", prompt, params)
    assert computed == len(prompt), "the prompt once, for every choice"
    assert sorted(outputs) == [0, 1, 2]
    assert all(out.req_id == "r" and out_goes_on(out) for out in outputs.values())
    assert [out.new_token_ids for out in outputs.values()] == [single[:1]] * 3
    assert len(source.kv.kept) == 1 and outputs[0].kept_block_ids
    assert not outputs[1].kept_block_ids and not outputs[2].kept_block_ids

    before = target.stats.num_computed_tokens
    hand_over(source, target, "r", prompt, params, outputs)
    assert target.forks.num_forked == 2
    tokens = run_choices(target)
    assert tokens == {("r", i): single[1:] for i in range(3)}
    assert target.stats.num_computed_tokens - before == 3 * (MAX_TOKENS - 1)


def test_recompute_after_a_failed_pull_still_runs_every_choice(
    make_engine: EngineFactory,
) -> None:
    source, target = make_engine(), make_engine()
    prompt = source.tokenize_prompt(PROMPT)
    target.add_request("ref", prompt, GREEDY)
    single = run_choices(target)[("ref", 0)]
    params = replace(GREEDY, n=3)
    outputs, _ = prefill(source, "r", prompt, params)
    hand_over(source, target, "r", prompt, params, outputs, fail=True)
    assert run_choices(target) == {("r", i): single[1:] for i in range(3)}


def seeded_params(source: Engine, prompt: list[int]) -> tuple[SamplingParams, list[int]]:
    """A seed whose choice 0 draws a first token no other choice draws, and the first tokens."""
    for seed in range(50):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.5, seed=seed, n=3)
        outputs, _ = prefill(source, f"probe{seed}", prompt, params)
        assert source.release_blocks(f"probe{seed}")
        firsts = [outputs[i].new_token_ids[0] for i in range(3)]
        if firsts[0] not in firsts[1:] and len(set(firsts)) == 3:
            return params, firsts
    raise AssertionError("no seed separates the choices' first tokens")


def test_a_choice_ending_on_its_first_token_keeps_the_lease_for_the_others(
    make_engine: EngineFactory,
) -> None:
    source, target = make_engine(), make_engine()
    prompt = source.tokenize_prompt(PROMPT)
    params, firsts = seeded_params(source, prompt)
    params = replace(params, stop_token_ids=(firsts[0],), ignore_eos=True)
    outputs, _ = prefill(source, "r", prompt, params)
    assert [outputs[i].new_token_ids[0] for i in range(3)] == firsts  # seed + i, as before
    assert outputs[0].finish_reason == "stop" and outputs[0].kept_block_ids
    assert out_goes_on(outputs[1]) and out_goes_on(outputs[2])
    assert len(source.kv.kept) == 1
    hand_over(source, target, "r", prompt, params, outputs)
    tokens = run_choices(target)
    assert sorted(tokens) == [("r", 1), ("r", 2)], "choice 0 ended at prefill"
    assert all(1 <= len(t) <= MAX_TOKENS - 1 for t in tokens.values())
    assert not target.is_unfinished("r")


def test_every_choice_ending_on_its_first_token_needs_no_decode(
    make_engine: EngineFactory,
) -> None:
    source = make_engine()
    prompt = source.tokenize_prompt(PROMPT)
    outputs, _ = prefill(source, "r", prompt, replace(GREEDY, max_tokens=1, n=3))
    assert [out.finish_reason for out in outputs.values()] == ["length"] * 3
    assert len(source.kv.kept) == 1  # the worker releases it: no choice goes on
    assert source.release_blocks("r")


def test_abort_while_the_prompt_kv_loads_drops_the_choices(make_engine: EngineFactory) -> None:
    source, target = make_engine(), make_engine()
    prompt = source.tokenize_prompt(PROMPT)
    params = replace(GREEDY, n=3)
    outputs, _ = prefill(source, "r", prompt, params)
    choices = PrefilledChoices({1: outputs[1].new_token_ids[0], 2: outputs[2].new_token_ids[0]})
    plan = target.add_prefilled_request(
        "r", prompt, outputs[0].new_token_ids[0], params, choices=choices
    )
    assert plan is not None and target.is_unfinished("r")
    assert target.abort("r") and not target.is_unfinished("r")
    assert source.release_blocks("r")
