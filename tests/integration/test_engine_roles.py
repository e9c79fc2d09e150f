"""Prefill and decode roles of the engine: leases, remote-KV admission, recompute fallback.

The KV moves between the two engines with a plain tensor copy here; NIXL moves it in the cluster.
"""

from __future__ import annotations

import pytest

from engine.sampling.sampling_params import SamplingParams
from tests.conftest import run_to_completion

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prefill(engine, req_id, prompt):
    engine.add_request(
        req_id, prompt, SamplingParams(max_tokens=1, temperature=0), keep_blocks=True
    )
    outs = [o for _ in range(100) if engine.has_unfinished_requests for o in engine.step()]
    [out] = [o for o in outs if o.req_id == req_id]
    assert out.finished and out.kept_block_ids
    return out.new_token_ids[0], list(out.kept_block_ids)


def test_prefill_then_decode_matches_single_engine(make_engine, tokenizer):
    prompt = tokenizer.encode("The history of the printing press begins " * 5)
    solo = make_engine()
    solo.add_request("solo", prompt, PARAMS)
    expected = run_to_completion(solo)["solo"]

    prefill_engine, decode_engine = make_engine(), make_engine()
    first, remote_ids = prefill(prefill_engine, "r", prompt)
    assert first == expected[0]
    assert len(prefill_engine.kv.kept) == 1
    plan = decode_engine.add_prefilled_request("r", prompt, first, PARAMS)
    assert plan is not None and plan.first_block == 0
    assert len(plan.local_block_ids) == len(remote_ids)
    decode_engine.kv_cache[list(plan.local_block_ids)] = prefill_engine.kv_cache[remote_ids]
    decode_engine.commit_kv("r")
    assert prefill_engine.release_blocks("r") and not prefill_engine.release_blocks("r")
    assert [first, *run_to_completion(decode_engine)["r"]] == expected


def test_decode_reuses_local_prefix_and_pulls_only_missing(make_engine, tokenizer):
    shared = tokenizer.encode("A shared system preamble about safety and tone. " * 6)
    prompt_a = shared + tokenizer.encode(" Question one?")
    prompt_b = shared + tokenizer.encode(" A different second question?")
    prefill_engine, decode_engine = make_engine(), make_engine()
    for req_id, prompt in (("a", prompt_a), ("b", prompt_b)):
        first, remote_ids = prefill(prefill_engine, req_id, prompt)
        plan = decode_engine.add_prefilled_request(req_id, prompt, first, PARAMS)
        assert plan is not None
        remote = remote_ids[plan.first_block : plan.first_block + len(plan.local_block_ids)]
        decode_engine.kv_cache[list(plan.local_block_ids)] = prefill_engine.kv_cache[remote]
        decode_engine.commit_kv(req_id)
        prefill_engine.release_blocks(req_id)
        run_to_completion(decode_engine)
        if req_id == "a":
            assert plan.first_block == 0
        else:
            assert plan.first_block == len(shared) // 16
            assert plan.num_cached_tokens == len(shared) // 16 * 16


def test_failed_pull_recomputes_locally(make_engine, tokenizer):
    prompt = tokenizer.encode("Recompute me when the transfer fails, please, kindly.")
    solo = make_engine()
    solo.add_request("solo", prompt, PARAMS)
    expected = run_to_completion(solo)["solo"]
    prefill_engine, decode_engine = make_engine(), make_engine()
    first, _ = prefill(prefill_engine, "r", prompt)
    assert decode_engine.add_prefilled_request("r", prompt, first, PARAMS) is not None
    decode_engine.fail_kv("r")  # nothing was copied: the blocks hold garbage
    prefill_engine.release_blocks("r")
    assert [first, *run_to_completion(decode_engine)["r"]] == expected


def test_abort_while_loading_and_aborted_prefill_frees(make_engine, tokenizer):
    prompt = tokenizer.encode("Abort me while my KV is in flight.")
    prefill_engine, decode_engine = make_engine(), make_engine()
    first, _ = prefill(prefill_engine, "r", prompt)
    decode_engine.add_prefilled_request("r", prompt, first, PARAMS)
    assert decode_engine.abort("r")
    prefill_engine.release_blocks("r")
    prefill_engine.add_request("p", prompt, SamplingParams(max_tokens=1), keep_blocks=True)
    assert prefill_engine.abort("p")
    assert len(prefill_engine.kv.kept) == 0


def test_no_room_returns_none(make_engine, tokenizer):
    decode_engine = make_engine(num_blocks=4)
    prompt = list(range(1, 60))
    assert decode_engine.add_prefilled_request("r", prompt, 5, PARAMS) is not None
    assert decode_engine.add_prefilled_request("s", prompt, 5, PARAMS) is None
    assert decode_engine.abort("r")


def test_prefill_only_requests_report_the_engines_finish_reason(make_engine, tokenizer):
    engine = make_engine()
    prompt = tokenizer.encode("Count to three:")
    cases = {
        "more": (SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), "first_token"),
        "one": (SamplingParams(max_tokens=1, temperature=0), "length"),
        "stop": (
            SamplingParams(
                max_tokens=5,
                temperature=0,
                stop_token_ids=tuple(range(engine.model_config.vocab_size)),
            ),
            "stop",
        ),
    }
    for req_id, (params, _) in cases.items():
        engine.add_request(req_id, prompt, params, keep_blocks=True)
    outs = {o.req_id: o for _ in range(50) if engine.has_unfinished_requests for o in engine.step()}
    assert {r: o.finish_reason for r, o in outs.items()} == {r: c[1] for r, c in cases.items()}
    assert all(o.finished and o.kept_block_ids for o in outs.values())
    for req_id in cases:
        engine.release_blocks(req_id)


def test_a_leased_request_id_is_refused_and_the_decode_engine_checks_its_own_limits(
    make_engine, tokenizer
):
    prefill_engine = make_engine()
    prompt = tokenizer.encode("Hold these blocks for the decode side.")
    prefill(prefill_engine, "r", prompt)
    with pytest.raises(ValueError, match="already in use"):
        prefill_engine.add_request("r", prompt, PARAMS, keep_blocks=True)
    assert prefill_engine.release_blocks("r")
    small = make_engine(num_blocks=4)  # 64 tokens at most
    with pytest.raises(ValueError, match="more than this decode engine can hold"):
        small.add_prefilled_request("long", list(range(1, 100)), 5, PARAMS)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        small.add_prefilled_request("bad", [1, 2, 3], -1, PARAMS)
    assert not small.has_unfinished_requests
