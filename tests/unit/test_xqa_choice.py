"""The decode-kernel choice (XQA for an fp8 cache on Hopper, fa2 otherwise), XQA's dense page
table, the split of a mixed step into its leading decode rows, the rows the paged prefill
wrapper takes and the trailing whole prompts (the ragged wrapper's: fa3 on Hopper over a
bf16/fp16 cache), and the backend "auto" builds. Pure functions: no GPU, no FlashInfer."""

from __future__ import annotations

import pytest
import torch

from engine.attention import flashinfer_backend
from engine.attention.base import SeqSpan
from engine.attention.dense_table import dense_page_table
from engine.attention.flashinfer_backend import (
    choose_backend,
    num_leading_decodes,
    ragged_backend,
    whole_prompts_from,
)
from engine.attention.xqa_decode import use_xqa

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


def test_xqa_takes_an_fp8_cache_on_hopper_only() -> None:
    assert use_xqa(FP8, HOPPER, 16, 128)
    assert not use_xqa(BF16, HOPPER, 16, 128)  # fa2 reads bf16 at the HBM rate
    assert not use_xqa(FP8, AMPERE, 16, 128)
    assert not use_xqa(FP8, BLACKWELL, 16, 128)
    assert not use_xqa(FP8, HOPPER, 8, 128)  # XQA pages are 16..128 tokens
    assert not use_xqa(FP8, HOPPER, 16, 96)


def test_dense_page_table_pads_each_row_to_the_width() -> None:
    seqs = [SeqSpan(0, 1, 17, [7, 3, 9]), SeqSpan(1, 1, 16, [4, 8]), SeqSpan(2, 1, 1, [5])]
    # 17 tokens need 2 pages (the third block id is not part of the context yet)
    assert dense_page_table(seqs, 16, 3) == [7, 3, 0, 4, 0, 0, 5, 0, 0]


def test_leading_decode_rows_of_a_mixed_step() -> None:
    decode, prefill = SeqSpan(0, 1, 5, [1]), SeqSpan(1, 8, 8, [2])
    assert num_leading_decodes([decode, decode, prefill, decode]) == 2
    assert num_leading_decodes([prefill, decode]) == 0
    assert num_leading_decodes([decode, decode]) == 2


def span(q_len: int, ctx_len: int) -> SeqSpan:
    return SeqSpan(0, q_len, ctx_len, [])


def test_whole_prompts_are_the_trailing_chunks_with_nothing_cached_before_them() -> None:
    decode, continued, after_cache = span(1, 40), span(24, 48), span(30, 62)
    whole = [span(40, 40), span(5, 5)]
    assert whole_prompts_from([decode, continued, *whole]) == 2
    assert whole_prompts_from(whole) == 0
    assert whole_prompts_from([*whole, after_cache]) == 3  # only a trailing run counts
    assert whole_prompts_from([decode, span(1, 1)]) == 2  # a one-token prompt is a decode row
    assert whole_prompts_from([]) == 0


def test_ragged_backend_is_fa3_on_hopper_over_a_16_bit_cache() -> None:
    assert ragged_backend(HOPPER, BF16, 128) == "fa3"
    assert ragged_backend(HOPPER, torch.float16, 64) == "fa3"
    assert ragged_backend(HOPPER, FP8, 128) is None  # slower beside FP8 GEMMs
    assert ragged_backend(AMPERE, BF16, 128) is None  # fa2's ragged kernel: not measured
    assert ragged_backend(HOPPER, BF16, 16) is None  # fa3 is not built for this head size


def test_auto_builds_flashinfer_only_for_head_sizes_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(flashinfer_backend, "flashinfer_available", lambda: True)
    cuda = torch.device("cuda")
    assert choose_backend("auto", cuda, BF16, 128) == "flashinfer"
    assert choose_backend("auto", cuda, BF16, 16) == "torch"  # fa2 fails a head of 16
    assert choose_backend("auto", torch.device("cpu"), BF16, 128) == "torch"


def test_flashinfer_asked_for_an_odd_head_size_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="head_dim is 16"):
        choose_backend("flashinfer", torch.device("cuda"), BF16, 16)
