"""IncrementalDetokenizer and StopChecker on the real SmolLM2 tokenizer."""

from __future__ import annotations

from engine.step.stop_checker import StopChecker
from engine.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Plain ASCII text, with punctuation!",
    "日本語のテキスト 🎉🎉 and emoji 👩‍👩‍👧 mixed",
    "  leading spaces and\nnew lines\n\n",
]


def test_deltas_concatenate_to_full_decode_without_broken_chars(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.add([t]) for t in ids]
        deltas.append(detok.flush())
        assert "".join(deltas) == tokenizer.decode(ids)
        assert not any("\ufffd" in d for d in deltas), deltas


def test_stop_string_spanning_tokens_never_leaks(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta epsilon")
    checker = StopChecker(tokenizer, ("gamma del",))
    emitted = ""
    for t in ids:
        emitted += checker.add(t)
        if checker.matched:
            break
    assert checker.matched == "gamma del"
    assert emitted == "alpha beta "
    assert checker.text == "alpha beta "
