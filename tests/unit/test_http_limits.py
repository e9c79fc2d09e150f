"""The router's size limits, each module alone: the proved token bound (against the real SmolLM2
tokenizer, on generated text), the body limit and its flag, and the published OpenAPI document."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from deploy.cli import build_parser
from deploy.router_flags import router_options
from engine.models.loader import resolve_model
from router.openapi import OPERATIONS, openapi_document
from router.request_size import MIB, max_body_bytes
from router.token_bound import TokenBound
from router.tokenizer import RouterTokenizer


@pytest.fixture(scope="module")
def router_tokenizer() -> RouterTokenizer:
    return RouterTokenizer(resolve_model("default"))


# Text that stresses the bound: the longest tokens are runs of spaces after a newline, special
# tokens are matched whole, and non-ASCII characters take several bytes each.
_PIECES = st.sampled_from(["\n" + " " * 80, " " * 64, "<|im_start|>", "<|endoftext|>", "😀", "é"])
_TEXT = st.lists(st.one_of(st.text(max_size=40), _PIECES), max_size=30).map("".join)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same examples on every run
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(text=_TEXT)
def test_no_text_encodes_to_fewer_tokens_than_the_bound(
    router_tokenizer: RouterTokenizer, text: str
) -> None:
    assert len(router_tokenizer.encode(text)) >= router_tokenizer.min_num_tokens(text)


def test_the_bound_is_tight_enough_to_refuse_a_long_prompt_early(
    router_tokenizer: RouterTokenizer,
) -> None:
    # SmolLM2 is byte-level BPE: its longest entry covers 81 bytes (a newline, 80 spaces).
    assert router_tokenizer.bound.bytes_per_token == 81
    assert router_tokenizer.min_num_tokens("a" * 8100) == 100
    assert router_tokenizer.min_num_tokens("") == 0


def _wordpiece(normalizer: normalizers.Normalizer | None) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer


def _byte_fallback_bpe(normalizer: normalizers.Normalizer | None) -> Tokenizer:
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁": 256, "▁ab": 257}
    tokenizer = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    tokenizer.normalizer = normalizer
    return tokenizer


def test_no_bound_is_claimed_where_text_may_vanish_or_shrink() -> None:
    # An unknown word is one [UNK] token whatever its length; whitespace is dropped; NFC and
    # stripping shrink text: no bound can be proved, so none is claimed.
    assert TokenBound.of(_wordpiece(None)).bytes_per_token is None
    assert TokenBound.of(_byte_fallback_bpe(normalizers.NFC())).bytes_per_token is None
    assert TokenBound.of(_byte_fallback_bpe(normalizers.Strip())).bytes_per_token is None
    assert TokenBound.of(_wordpiece(None)).min_num_tokens("x" * 10**6) == 0
    # Llama-2's normalizer only widens text (a leading "▁", spaces to "▁"): the bound holds.
    spm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer = _byte_fallback_bpe(spm)
    bound = TokenBound.of(tokenizer)
    assert bound.bytes_per_token == len("<0x00>")
    for text in ("ab ab", "x" * 100, "é😀 z"):
        assert len(tokenizer.encode(text).ids) >= bound.min_num_tokens(text) > 0


def test_the_body_limit_is_derived_from_the_context_unless_set() -> None:
    assert max_body_bytes(8192) == 4 * MIB  # a few MiB at least
    assert max_body_bytes(1 << 20) == 32 << 20  # 32 bytes a token of a long context
    assert max_body_bytes(8192, 0.5) == MIB // 2


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "4096"])
def test_a_bad_body_limit_is_refused_naming_the_flag(value: str) -> None:
    args = build_parser().parse_args(["serve", "--max-body-mib", value])
    with pytest.raises(ValueError, match=r"--max-body-mib must be in \(0, 2047\]"):
        router_options(args)


def test_the_flag_becomes_the_option() -> None:
    options = router_options(build_parser().parse_args(["router", "--max-body-mib", "2"]))
    assert options.max_body_mib == 2
    assert any("body limit     2 MiB" in line for line in options.describe())


def test_the_openapi_document_describes_every_route_with_valid_schemas() -> None:
    document = openapi_document("test")
    assert document["openapi"].startswith("3.1")
    json.dumps(document)  # plain JSON
    for op in OPERATIONS:
        assert op.method in document["paths"][op.path]
    schemas = document["components"]["schemas"]
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)  # raises naming what is wrong
    chat = {"$ref": "#/components/schemas/ChatCompletionRequest", **document}
    validator = Draft202012Validator(chat)
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert validator.is_valid(good)
    assert not validator.is_valid({**good, "max_tokens": "three"})
    assert not validator.is_valid({"model": "m"})
