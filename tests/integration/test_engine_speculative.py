"""Speculative decoding (n-gram drafting) in the engine: greedy output equals the output
without speculation token for token (SmolLM2 on text that repeats its prompt, a tiny random
model whose output loops, a tiny sparse-MoE model), seeded sampling keeps the target's draws,
drafts respect max_tokens and stop tokens, a request may turn it off, and no block leaks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from engine.config import SpeculativeConfig
from engine.sampling.sampling_params import SamplingParams
from engine.speculation.speculation_cost import CostGuard
from tests.conftest import build_engine, run_to_completion
from tests.factories import make_tiny_checkpoint

# adaptive off: these tests count drafts, which the cost guard may pause on a busy machine
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, adaptive=False)
PARAGRAPH = (
    "The old lighthouse keeper climbed the spiral stairs every evening, lit the great lamp, "
    "and watched the ships pass safely through the narrow channel below the cliffs."
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-spec"), vocab_size=64, seed=5)


def generate(engine, prompts, params) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    out = run_to_completion(engine)
    engine.assert_no_leaks()
    return out


def test_smollm2_greedy_output_is_the_same_with_ngram_drafting(make_engine, tokenizer):
    """A rewrite of the prompt's paragraph (the answer repeats it) and an unrelated question,
    batched: the same tokens with and without speculation, in fewer steps, drafts accepted."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat this paragraph word for word: {PARAGRAPH}"}]
        ),
        tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}]),
    ]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    plain = make_engine()
    speculating = make_engine(speculative=NGRAM)
    expected = generate(plain, prompts, params)
    assert generate(speculating, prompts, params) == expected
    spec = speculating.speculator
    assert spec.num_accepted_tokens > 10, (spec.num_drafted_tokens, spec.num_accepted_tokens)
    assert (
        speculating.stats.num_generated_tokens
        == plain.stats.num_generated_tokens
        == sum(len(tokens) for tokens in expected.values())
    )
    alone = make_engine(speculative=NGRAM)  # the repeating answer alone: fewer steps than tokens
    assert generate(alone, prompts[:1], params) == {"r0": expected["r0"]}
    assert alone.stats.num_steps < len(expected["r0"]) - 5, alone.stats


def test_tiny_model_greedy_output_is_the_same_over_prompts_and_draft_lengths(tiny):
    """A random model's greedy output loops, so drafts are often right and often wrong: every
    K gives the plain output, with blocks of 4 tokens crossed by accepted and rejected drafts."""
    prompts = [[5, 17, 30, 42, 17, 5], list(range(1, 60, 3)), [7], [9, 9, 9, 9]]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    expected = generate(build_engine(model_path=str(tiny), block_size=4), prompts, params)
    for k in (1, 3, 8):
        config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=k, ngram_min=1, adaptive=False
        )
        engine = build_engine(model_path=str(tiny), block_size=4, speculative=config)
        assert generate(engine, prompts, params) == expected, k
        assert engine.speculator.num_accepted_tokens > 0
        assert engine.speculator.num_drafted_tokens > engine.speculator.num_accepted_tokens


def test_a_tiny_moe_models_greedy_output_is_the_same_with_ngram_drafting(tmp_path):
    """Qwen3-MoE (4 experts, top-2): a verify step routes its K + 1 rows per sequence through
    the experts together; the output is the plain engine's."""
    moe = make_tiny_checkpoint(tmp_path, architecture="qwen3_moe", vocab_size=64, seed=5)
    prompts = [[5, 17, 30, 42, 17, 5], list(range(1, 60, 3)), [9, 9, 9, 9]]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = generate(build_engine(model_path=str(moe), block_size=4), prompts, params)
    engine = build_engine(model_path=str(moe), block_size=4, speculative=NGRAM)
    assert generate(engine, prompts, params) == expected
    assert engine.speculator.num_drafted_tokens > engine.speculator.num_accepted_tokens > 0


def test_seeded_sampling_keeps_the_targets_draws(tiny):
    """Temperature 0.5 over 120 seeds: every verified row draws its position's own seeded
    sample, so the outputs match the plain engine's seed for seed (allowing a few float
    differences between a verify chunk and a decode), and the token frequencies match."""
    prompts = [[9, 9, 9, 9, 9, 9]]
    outputs: dict[bool, list[list[int]]] = {False: [], True: []}
    accepted = 0
    for speculate in (False, True):
        config = NGRAM if speculate else SpeculativeConfig()
        engine = build_engine(model_path=str(tiny), block_size=4, speculative=config)
        for seed in range(120):
            params = SamplingParams(max_tokens=12, temperature=0.5, seed=seed)
            outputs[speculate].append(generate(engine, prompts, params)["r0"])
        accepted += engine.speculator.num_accepted_tokens
    assert accepted > 50
    same = sum(a == b for a, b in zip(outputs[False], outputs[True], strict=True))
    assert same >= 114, same
    counts = [Counter(t for out in outputs[s] for t in out) for s in (False, True)]
    total = sum(counts[0].values())
    distance = sum(abs(counts[0][t] - counts[1][t]) for t in counts[0] | counts[1]) / (2 * total)
    assert distance < 0.05, distance


def test_drafts_stop_at_max_tokens_and_stop_tokens(tiny):
    """A draft never runs past max_tokens, and a stop token inside accepted drafts ends the
    request there, exactly as without speculation."""
    prompt = [9, 9, 9, 9, 9, 9]
    plain = generate(
        build_engine(model_path=str(tiny)), [prompt], SamplingParams(max_tokens=30, temperature=0)
    )["r0"]
    stop_token = Counter(plain[4:]).most_common(1)[0][0]
    for params in (
        SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(stop_token,)),
    ):
        expected = generate(build_engine(model_path=str(tiny)), [prompt], params)
        engine = build_engine(model_path=str(tiny), speculative=NGRAM)
        got = generate(engine, [prompt], params)
        assert got == expected
        assert len(got["r0"]) <= params.max_tokens


def test_a_request_can_turn_speculation_off(tiny):
    prompt = [9, 9, 9, 9]
    engine = build_engine(model_path=str(tiny), speculative=NGRAM)
    params = SamplingParams(max_tokens=24, temperature=0.0, speculative=False)
    generate(engine, [prompt], params)
    assert engine.speculator.num_drafted_tokens == 0
    generate(engine, [prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert engine.speculator.num_drafted_tokens > 0


def test_speculation_steps_aside_above_max_batch(tiny):
    """More running requests than max_batch: nobody drafts (the steps run as plain decodes,
    launched ahead), and the output is unchanged."""
    prompts = [[9, 9, 9, i] for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = generate(build_engine(model_path=str(tiny)), prompts, params)
    config = SpeculativeConfig(method="ngram", ngram_min=1, max_batch=4, adaptive=False)
    engine = build_engine(model_path=str(tiny), speculative=config)
    assert generate(engine, prompts, params) == expected
    assert engine.speculator.num_drafted_tokens == 0


def test_smollm2_drafting_for_itself_is_token_exact_and_almost_always_accepted(
    make_engine, tokenizer
):
    """The draft model is the target (its weights shared): its greedy drafts are the target's
    greedy tokens, so nearly all are accepted; the output is the plain one, and neither
    engine leaks a block."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem."}]),
        tokenizer.apply_chat_template([{"role": "user", "content": "Name three rivers."}]),
    ]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = generate(make_engine(), prompts, params)
    config = SpeculativeConfig(method="draft", draft_model="default", adaptive=False)
    engine = make_engine(speculative=config)
    assert generate(engine, prompts, params) == expected
    spec = engine.speculator
    assert spec.num_accepted_tokens >= 0.9 * spec.num_drafted_tokens > 20
    assert engine.stats.num_steps < len(expected["r0"])
    assert spec.draft_model is not None
    spec.draft_model.engine.assert_no_leaks()


DRAFT_PROMPTS = [[9, 9, 9, 9], [5, 17, 30, 42, 17, 5], list(range(1, 60, 3))]


def check_drafts_keep_the_output(target: Path, draft: Path, max_tokens: int) -> None:
    """The target with `draft` drafting gives the plain engine's greedy output for every
    prompt; it drafted, and neither engine holds a block after."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    expected = generate(build_engine(model_path=str(target), block_size=4), DRAFT_PROMPTS, params)
    config = SpeculativeConfig(method="draft", draft_model=str(draft), adaptive=False)
    engine = build_engine(model_path=str(target), block_size=4, speculative=config)
    assert generate(engine, DRAFT_PROMPTS, params) == expected
    spec = engine.speculator
    assert spec.num_drafted_tokens > 0
    assert spec.draft_model is not None
    spec.draft_model.engine.assert_no_leaks()
    engine.assert_no_leaks()


def test_a_tiny_random_draft_for_a_tiny_random_target_is_token_exact(tiny, tmp_path):
    """Another random model of the same vocabulary drafts: most drafts are wrong, some
    right (both models loop), and the output is the plain one for every prompt."""
    draft = make_tiny_checkpoint(tmp_path / "draft", vocab_size=64, seed=6, num_layers=1)
    check_drafts_keep_the_output(tiny, draft, max_tokens=32)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "mixtral"])
def test_a_new_familys_target_with_a_small_draft_of_its_own_family_is_token_exact(family, tmp_path):
    """The model families of issue 49 under draft-model speculation: a one-layer draft of the
    same family and vocabulary drafts for a two-layer target (Qwen3's q/k norms, the MoE
    experts in the verify rows); the output is the plain engine's, the draft engine leak-free."""
    target = make_tiny_checkpoint(tmp_path / "target", architecture=family, vocab_size=64, seed=5)
    draft = make_tiny_checkpoint(
        tmp_path / "draft", architecture=family, vocab_size=64, seed=6, num_layers=1
    )
    check_drafts_keep_the_output(target, draft, max_tokens=24)


def test_a_draft_step_that_raises_leaves_the_draft_engine_empty(tiny, tmp_path):
    """The draft engine's step raising fails the target's step; once the target ends that
    step's requests (Engine.fail_running, as its engine thread does), the draft engine holds
    none of them (before, they stayed, their blocks held and their ids taken) and the next
    requests are token-exact."""
    draft = make_tiny_checkpoint(tmp_path / "draft", vocab_size=64, seed=6, num_layers=1)
    prompts = [[9, 9, 9, 9], [5, 17, 30, 42, 17, 5]]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    expected = generate(build_engine(model_path=str(tiny), block_size=4), prompts, params)
    config = SpeculativeConfig(method="draft", draft_model=str(draft), adaptive=False)
    engine = build_engine(model_path=str(tiny), block_size=4, speculative=config)
    assert engine.speculator.draft_model is not None
    drafts = engine.speculator.draft_model.engine
    real_step, calls = drafts.step, []

    def step_failing_once():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected draft step failure")
        return real_step()

    drafts.step = step_failing_once
    for i, prompt in enumerate(prompts):
        engine.add_request(f"x{i}", prompt, params)
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished_requests:
            engine.step()
    assert sorted(engine.fail_running()) == ["x0", "x1"]
    assert not drafts.has_unfinished_requests
    drafts.assert_no_leaks()
    assert generate(engine, prompts, params) == expected
    drafts.assert_no_leaks()


def test_a_draft_model_of_another_vocabulary_is_refused(tiny, tmp_path):
    draft = make_tiny_checkpoint(tmp_path / "draft", vocab_size=128, weights=False)
    config = SpeculativeConfig(method="draft", draft_model=str(draft))
    with pytest.raises(ValueError, match="must share the target"):
        build_engine(model_path=str(tiny), speculative=config, load_format="dummy")


def test_bad_speculative_configs_are_refused():
    with pytest.raises(ValueError, match="needs a draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="needs a draft_model"):
        SpeculativeConfig(method="ngram", draft_model="default")
    with pytest.raises(ValueError, match="one of"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)


def test_the_cost_guard_switching_modes_keeps_the_output(tiny):
    """The default (adaptive) engine with a guard that switches every few steps: speculating
    and plain steps (run ahead) alternate within each request, and the output is unchanged."""
    prompts = [[9, 9, 9, 9], [5, 17, 30, 42, 17, 5]]
    params = SamplingParams(max_tokens=40, temperature=0.0)
    expected = generate(build_engine(model_path=str(tiny), block_size=4), prompts, params)
    engine = build_engine(
        model_path=str(tiny), block_size=4, speculative=SpeculativeConfig(method="ngram")
    )
    engine.speculator.guard = CostGuard(window=2, hold=3)
    assert generate(engine, prompts, params) == expected
    assert engine.speculator.guard.num_switches >= 4
    assert engine.speculator.num_accepted_tokens > 0


class RecordingGraphs:
    """A DecodeGraphs that runs the runner's eager forward and keeps each step's inputs: what
    the runner hands a CUDA-graph replayer, seen on the CPU."""

    def __init__(self, runner, max_rows: int = 64):
        self.runner, self.max_rows, self.steps = runner, max_rows, []

    def padded_size(self, num_seqs: int) -> int | None:
        return num_seqs if num_seqs <= self.max_rows else None

    def run(self, inputs, fill=None):
        self.steps.append(inputs)
        return self.runner._forward_eager(inputs, fill)


def test_verify_steps_are_pure_decode_steps_a_graph_replays(tiny):
    """Each verified token is a decode row that sees the cache up to itself, so decode +
    verify steps go to the decode graphs; the output is unchanged."""
    prompts = [[9, 9, 9, 9], [5, 17, 30, 42, 17, 5]]
    params = SamplingParams(max_tokens=30, temperature=0.0)
    expected = generate(build_engine(model_path=str(tiny), block_size=4), prompts, params)
    engine = build_engine(model_path=str(tiny), block_size=4, speculative=NGRAM)
    graphs = engine.runner.graphs = RecordingGraphs(engine.runner)
    assert generate(engine, prompts, params) == expected
    verifies = [step for step in graphs.steps if len(step.seqs) > len(prompts)]
    assert verifies and engine.speculator.num_accepted_tokens > 0
    for step in verifies:
        assert all(seq.q_len == 1 for seq in step.seqs)
        by_blocks: dict[int, list[int]] = {}
        for seq in step.seqs:  # one request's rows: consecutive contexts over the same blocks
            by_blocks.setdefault(seq.block_ids[0], []).append(seq.ctx_len)
        for ctx_lens in by_blocks.values():
            assert ctx_lens == list(range(ctx_lens[0], ctx_lens[0] + len(ctx_lens)))
        assert [seq.ctx_len - 1 for seq in step.seqs] == step.positions
    assert engine.runner.num_graph_steps == len(graphs.steps) > len(verifies)
