"""ResponseContext (router/openai_format.py): the logprobs of a response are valid JSON and
their `bytes` rebuild the text (SmolLM2's byte-level tokenizer, no model)."""

from __future__ import annotations

import json
import math

import pytest

from engine.finish_reason import FinishReason
from engine.models.loader import resolve_model
from router.openai_format import MIN_LOGPROB, ResponseContext
from router.output import OutputChunk, Usage
from router.tokenizer import RouterTokenizer

TEXT = "日本語 😀 ok"  # byte-level BPE splits the CJK characters and the emoji across tokens


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    return RouterTokenizer(resolve_model("default"))


def response(tokenizer: RouterTokenizer, chat: bool, token_ids: list[int]) -> dict:
    ctx = ResponseContext("r", "m", chat, tokenizer, want_logprobs=True)
    top = ((token_ids[0], -0.5), (7, -math.inf))  # a token a grammar ruled out
    ctx.add(
        OutputChunk(
            tuple(token_ids),
            TEXT,
            logprobs=(-math.inf, *([-0.25] * (len(token_ids) - 1))),
            finish_reason=FinishReason.STOP,
            top_logprobs=tuple([top] * len(token_ids)),
        )
    )
    body = json.dumps(ctx.final(Usage(1, len(token_ids), 0)), allow_nan=False)  # strict JSON
    return json.loads(body)


def test_a_ruled_out_tokens_logprob_is_a_finite_floor(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    chat = response(tokenizer, True, ids)["choices"][0]["logprobs"]["content"]
    assert chat[0]["logprob"] == MIN_LOGPROB and chat[1]["logprob"] == -0.25
    assert chat[0]["top_logprobs"][1]["logprob"] == MIN_LOGPROB
    completion = response(tokenizer, False, ids)["choices"][0]["logprobs"]
    assert completion["token_logprobs"][0] == MIN_LOGPROB
    assert MIN_LOGPROB in completion["top_logprobs"][0].values()


def test_chat_logprob_bytes_rebuild_text_split_inside_characters(
    tokenizer: RouterTokenizer,
) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    content = response(tokenizer, True, ids)["choices"][0]["logprobs"]["content"]
    assert any(entry["token"] == "\ufffd" for entry in content)  # decoded alone: a fragment
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == TEXT
    first = content[0]["top_logprobs"][0]  # the same token among the top ones: the same bytes
    assert first["bytes"] == content[0]["bytes"]


def expected_offsets(tokenizer: RouterTokenizer, ids: list[int], text: str) -> list[int]:
    """Each token's start in text, in characters: the character its first byte belongs to."""
    raw, offsets, start = text.encode(), [], 0
    for token_id in ids:
        offsets.append(len(raw[:start].decode("utf-8", "ignore")))
        start += len(tokenizer.token_bytes(token_id))
    assert start == len(raw)
    return offsets


def test_text_offsets_count_a_split_character_once(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    expected = expected_offsets(tokenizer, ids, TEXT)
    assert expected[-1] < len(TEXT)  # counting each fragment as a character overshot the text
    final = response(tokenizer, False, ids)["choices"][0]["logprobs"]
    assert final["text_offset"] == expected

    # streamed one token a chunk: a character split across chunks starts where it starts
    ctx = ResponseContext("r", "m", False, tokenizer, want_logprobs=True)
    raw, sent, offsets = TEXT.encode(), 0, []
    for i, token_id in enumerate(ids):
        upto = len(b"".join(tokenizer.token_bytes(t) for t in ids[: i + 1]))
        text = raw[:upto].decode("utf-8", "ignore")  # what the detokenizer has released
        chunk = ctx.chunk(OutputChunk((token_id,), text[sent:], logprobs=(-0.5,)))
        sent = len(text)
        offsets += chunk["choices"][0]["logprobs"]["text_offset"]
    assert offsets == expected
