"""n > 1 in the engine (engine/step/fork.py) on the real SmolLM2: the prompt is computed once, its
full blocks are shared and its partial block copied, each choice decodes on its own, and no
path leaks a block."""

from __future__ import annotations

import pytest

from engine.engine import Engine
from engine.sampling.sampling_params import SamplingParams
from tests.conftest import EngineFactory

PROMPT = "The three largest rivers of Europe are"
MAX_TOKENS = 8


def run_choices(engine: Engine, max_steps: int = 10_000) -> dict[tuple[str, int], list[int]]:
    """Step until idle; returns (req_id, choice index) -> generated token ids."""
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests:
            return tokens
        for out in engine.step():
            tokens.setdefault((out.req_id, out.index), []).extend(out.new_token_ids)
        engine.check_integrity()
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_choices_equal_the_single_greedy_output_and_the_prompt_is_computed_once(
    make_engine: EngineFactory, overlap: bool
) -> None:
    engine = make_engine(async_scheduling=overlap)
    prompt = engine.tokenize_prompt(PROMPT)
    assert len(prompt) % engine.kv.block_size, "the test wants a partial last block"
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("one", prompt, greedy)
    single = run_choices(engine)[("one", 0)]
    engine.kv.pool.evict_all_cached()  # the n=3 request finds nothing in the prefix cache

    before = engine.stats.num_computed_tokens
    engine.add_request("three", prompt, SamplingParams(**{**greedy.__dict__, "n": 3}))
    choices = run_choices(engine)
    assert choices == {("three", i): single for i in range(3)}
    # The prompt once, then each choice's decodes (its first token came from the prompt).
    computed = engine.stats.num_computed_tokens - before
    assert computed == len(prompt) + 3 * (MAX_TOKENS - 1)
    assert engine.forks.num_forked == 2 and engine.forks.num_recomputed == 0


def test_forked_choices_share_full_blocks_and_copy_the_partial_one(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine()
    prompt = engine.tokenize_prompt(PROMPT * 3)
    block_size = engine.kv.block_size
    num_full = len(prompt) // block_size
    assert num_full >= 1 and len(prompt) % block_size
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, n=3)
    engine.add_request("r", prompt, params)
    while not engine.forks.live_choices("r"):
        engine.step()
    tables = [engine.kv.block_ids(req_id) for req_id in ("r", "r#1", "r#2")]
    assert tables[0][:num_full] == tables[1][:num_full] == tables[2][:num_full]
    partial = {table[num_full] for table in tables}
    assert len(partial) == 3, "each choice writes its own copy of the partial block"
    shared = engine.kv.pool.blocks[tables[0][0]]
    assert shared.ref_cnt == 3
    src, dst = tables[0][num_full], tables[1][num_full]
    offset = len(prompt) % block_size
    engine.step()  # the copy is queued with the next step's, before its forward pass
    kv = engine.kv_cache  # the prompt's part of the copied block is the parent's KV
    assert kv[dst][:, :, :, :offset].equal(kv[src][:, :, :, :offset])
    run_choices(engine)


def test_seeded_choices_differ_and_are_reproducible(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = engine.tokenize_prompt(PROMPT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=3, ignore_eos=True)
    engine.add_request("a", prompt, params)
    first = run_choices(engine)
    engine.add_request("b", prompt, params)
    second = run_choices(engine)
    runs = [[first[("a", i)] for i in range(3)], [second[("b", i)] for i in range(3)]]
    assert runs[0] == runs[1]
    assert len({tuple(tokens) for tokens in runs[0]}) > 1, "seed + i gives each choice its own"
    # Choice i draws as a single request seeded with seed + i would.
    engine.add_request("c", prompt, SamplingParams(**{**params.__dict__, "n": 1, "seed": 9}))
    assert run_choices(engine)[("c", 0)] == runs[0][2]


def test_abort_ends_every_choice_and_frees_their_blocks(make_engine: EngineFactory) -> None:
    engine = make_engine()
    prompt = engine.tokenize_prompt(PROMPT)
    engine.add_request("r", prompt, SamplingParams(max_tokens=100, ignore_eos=True, n=4))
    for _ in range(3):
        engine.step()
    assert len(engine.forks.live_choices("r")) == 3
    assert engine.abort("r")
    assert not engine.has_unfinished_requests and engine.forks.num_live == 0
    assert not engine.abort("r")


def test_a_choice_that_ends_on_its_first_token_and_one_without_room(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(max_num_seqs=2)  # one batch slot for the choices: the last waits
    prompt = engine.tokenize_prompt(PROMPT)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("ref", prompt, greedy)
    ref = run_choices(engine)[("ref", 0)]
    engine.add_request("r", prompt, SamplingParams(**{**greedy.__dict__, "n": 3}))
    assert run_choices(engine) == {("r", i): ref for i in range(3)}
    assert engine.forks.num_forked == 1 and engine.forks.num_recomputed == 1
    engine.add_request("one", prompt, SamplingParams(max_tokens=1, n=3, temperature=0))
    assert run_choices(engine) == {("one", i): ref[:1] for i in range(3)}
