"""The start-up warm-up (engine/warm_up.py): which prompt lengths it runs, and that an engine
that ran it serves exactly as one that did not, with nothing of it left behind (no request, no
cached block on any tier, no KV event, no counter). It runs on CUDA by default; here it is
asked for on the CPU, where the same steps run."""

from __future__ import annotations

import pytest

from engine import warm_up
from engine.attention.rope_kv_kernel import heads_per_program
from engine.config import SpeculativeConfig
from engine.sampling.sampling_params import SamplingParams
from engine.warm_up import NUM_DECODERS, split_prompt, step_sizes
from tests.conftest import run_to_completion


def test_sizes_reach_every_step_size_within_a_factor_of_one_and_a_half() -> None:
    sizes = step_sizes(8192)
    assert sizes[0] == 1 and 8192 in sizes and 8192 + 4096 in sizes
    assert all(any(n <= t <= 1.5 * n for n in sizes) for t in range(1, 8193))
    # every variant of the RoPE/KV-write kernel a step of <= 8,192 tokens can launch (the 8B
    # shape's 32 + 8 heads) is met by some warm-up size
    wanted = {heads_per_program(t, 40) for t in range(1, 8193)}
    assert wanted <= {heads_per_program(n, 40) for n in sizes}
    # ... at both parities of the step's token count too (an odd count's packed per-token rows
    # are not 16-byte aligned, a variant of its own where Triton specializes on alignment): the
    # sizes alone, then beside NUM_DECODERS decodes (with 8 the odd ones of 2..64 heads a
    # program were never met)
    both = {(heads_per_program(t, 40), t % 2) for t in range(1, 8193)}
    beside = [n + NUM_DECODERS for n in sizes if n + NUM_DECODERS <= 8192]
    assert both <= {(heads_per_program(n, 40), n % 2) for n in [*sizes, *beside]}
    # a size longer than a prompt may be: prompts that fit, together that size
    assert split_prompt(8192, 4095) == [2731, 2731, 2730] and split_prompt(100, 4095) == [100]


DRAFT = SpeculativeConfig(method="draft", draft_model="default", adaptive=False)


@pytest.mark.parametrize(
    ("temperature", "shape"),
    [
        (0.0, {}),
        (0.8, {}),  # the sampler's seeded draws start where a cold engine's do
        (0.0, {"max_model_len": 48, "max_num_batched_tokens": 128}),  # sizes over 2-3 prompts
        (0.0, {"host_kv_cache_bytes": 8 << 20}),  # a host tier the warm-up must not fill
        (0.0, {"speculative": DRAFT}),  # its decoders draft through the draft engine
    ],
    ids=["greedy", "seeded", "split", "host-tier", "draft"],
)
def test_an_engine_that_warmed_up_serves_as_one_that_did_not(make_engine, temperature, shape):
    common = {"max_num_batched_tokens": 64, "num_blocks": 256, "record_kv_events": True, "seed": 7}
    common.update(shape)
    warm = make_engine(warm_up=True, **common)
    cold = make_engine(warm_up=False, **common)
    # nothing of the warm-up is left: no block cached on any tier, no KV event to publish, no
    # counter (its requests were not cacheable; the engine's step parts are new)
    snap = warm.snapshot()
    assert warm.kv.pool.num_cached_blocks == 0 and snap.num_host_offloaded_blocks == 0
    assert warm.drain_kv_events() == []
    assert (snap.num_computed_tokens, warm.stats.num_steps, warm.kv.num_lookup_blocks) == (0, 0, 0)
    draft = warm.speculator.draft_model
    if draft is not None:  # the warm-up drafted, keeping nothing in the draft engine's cache
        assert draft.engine.stats.num_steps > 0 and draft.engine.kv.pool.num_cached_blocks == 0
    warm.assert_no_leaks()
    params = SamplingParams(max_tokens=12, temperature=temperature)
    prompts = {"a": list(range(100, 130)), "b": list(range(300, 317))}
    outputs = []
    for engine in (warm, cold):
        for req_id, prompt in prompts.items():
            engine.add_request(req_id, prompt, params)
        outputs.append(run_to_completion(engine))
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[0].values())


def test_a_warm_up_says_what_it_runs_and_how_far_it_is(make_engine, monkeypatch, capfd):
    """A first start compiles kernels for a minute or more on a GPU: its start is said at once
    and its progress every PROGRESS_EVERY_S (0 here: after every pass)."""
    monkeypatch.setattr(warm_up, "PROGRESS_EVERY_S", 0.0)
    capfd.readouterr()
    make_engine(warm_up=True, max_num_batched_tokens=16, num_blocks=64)
    lines = [line for line in capfd.readouterr().err.splitlines() if "warm-up" in line]
    sizes = step_sizes(16)
    passes = [line for line in lines if " passes, " in line]
    assert "warm-up: 9 step sizes (1..24 prompt tokens), alone and beside 7" in lines[0]
    assert len(sizes) == 9 and len(passes) == 2 * len(sizes)
    assert f"warm-up: {2 * len(sizes)} of {2 * len(sizes)} passes" in passes[-1]
    assert "steps in" in lines[-1]  # the report
