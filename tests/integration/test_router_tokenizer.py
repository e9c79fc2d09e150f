"""The router's torch-free tokenizer agrees with the engine's (transformers) on SmolLM2."""

from __future__ import annotations

import pytest

from router.tokenizer import IncrementalDetokenizer, RouterTokenizer, StopChecker

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "日本語のテキスト 🎉🎉 and emoji 👩‍👩‍👧 mixed",
    "  leading spaces and\nnew lines\n\n",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "Name three rivers."}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Ça va ?"},
    ],
]


@pytest.fixture(scope="module")
def router_tokenizer(smollm_dir) -> RouterTokenizer:
    return RouterTokenizer(smollm_dir)


def test_encode_decode_and_vocab_match_transformers(router_tokenizer, tokenizer) -> None:
    for text in TEXTS:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert router_tokenizer.encode(text, add_special_tokens=special) == ids, text
        for skip in (True, False):
            assert router_tokenizer.decode(ids, skip) == tokenizer.decode(ids, skip), text
    assert router_tokenizer.vocab_size == tokenizer.vocab_size
    assert tokenizer.eos_token_id in router_tokenizer.eos_token_ids


def test_chat_template_matches_transformers(router_tokenizer, tokenizer) -> None:
    for messages in CHATS:
        assert router_tokenizer.apply_chat_template(messages) == tokenizer.apply_chat_template(
            messages
        )


def test_incremental_deltas_concatenate_to_full_decode(router_tokenizer) -> None:
    for text in TEXTS:
        ids = router_tokenizer.encode(text)
        detok = IncrementalDetokenizer(router_tokenizer)
        deltas = [detok.add([t]) for t in ids] + [detok.flush()]
        assert "".join(deltas) == router_tokenizer.decode(ids)
        assert not any("\ufffd" in d for d in deltas), deltas


def test_stop_string_spanning_tokens_never_leaks(router_tokenizer) -> None:
    ids = router_tokenizer.encode("alpha beta gamma delta epsilon")
    checker = StopChecker(router_tokenizer, ("gamma del", "zeta"))
    emitted = ""
    for t in ids:
        emitted += checker.add(t)
        if checker.matched:
            break
    assert checker.matched == "gamma del"
    assert emitted == checker.text == "alpha beta "


def test_without_a_stop_match_the_held_back_tail_is_released(router_tokenizer) -> None:
    ids = router_tokenizer.encode("no stop here at all")
    checker = StopChecker(router_tokenizer, ("xyzzy",))
    emitted = "".join(checker.add(t) for t in ids) + checker.finish()
    assert checker.matched is None
    assert emitted == "no stop here at all"


def test_only_a_tail_that_may_start_a_stop_string_is_held_back(router_tokenizer) -> None:
    checker = StopChecker(router_tokenizer, (" city",))
    ids = router_tokenizer.encode(" Paris is a c")
    emitted = "".join(checker.add(t) for t in ids)
    assert emitted == " Paris is a"  # " c" may still become " city"
    assert checker.finish() == " c"


STOPS = [(" ",), ("a",), ("ext",), ("🎉",), ("\n\n",), ("ASCII text", "ASCII"), ("zz", "mixed")]


@pytest.mark.parametrize("stop", STOPS)
def test_output_is_the_text_cut_at_the_first_stop_string(router_tokenizer, stop) -> None:
    for text in TEXTS:
        full = router_tokenizer.decode(router_tokenizer.encode(text))
        hits = [pos for s in stop if (pos := full.find(s)) >= 0]
        expected = full[: min(hits)] if hits else full
        checker = StopChecker(router_tokenizer, stop)
        emitted = ""
        for token_id in router_tokenizer.encode(text):
            emitted += checker.add(token_id)
            assert not any(s in emitted for s in stop)
        emitted += checker.finish()
        assert emitted == expected, (text, stop)
        assert (checker.matched is not None) == bool(hits)
