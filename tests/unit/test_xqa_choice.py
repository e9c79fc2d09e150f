"""The decode-kernel choice (XQA for an fp8 cache on Hopper, fa2 otherwise; forced by
KVRELAY_DECODE_KERNEL), the prefill kernel (fa3 on Hopper when KVRELAY_PREFILL_FA3=1), XQA's
dense page table, the split of a mixed step into its leading decode rows, the rows the paged
prefill wrapper takes and the trailing whole prompts (the ragged wrapper's: fa3 on Hopper over
a bf16/fp16 cache by default; KVRELAY_PREFILL_RAGGED: 1 fa3 on Hopper else fa2, fa2 / fa3, 0).
Pure functions: no GPU, no FlashInfer."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import SeqSpan
from engine.attention.dense_table import dense_page_table
from engine.attention.flashinfer_backend import (
    PREFILL_FA3_ENV,
    PREFILL_RAGGED_ENV,
    num_leading_decodes,
    prefill_backend,
    ragged_backend,
    whole_prompts_from,
)
from engine.attention.xqa_decode import DECODE_KERNEL_ENV, decode_kernel_choice, use_xqa

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16
HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


def test_auto_takes_xqa_for_an_fp8_cache_on_hopper_only() -> None:
    assert use_xqa("auto", FP8, HOPPER, 16, 128)
    assert not use_xqa("auto", BF16, HOPPER, 16, 128)  # fa2 reads bf16 at the HBM rate
    assert not use_xqa("auto", FP8, AMPERE, 16, 128)
    assert not use_xqa("auto", FP8, BLACKWELL, 16, 128)
    assert not use_xqa("auto", FP8, HOPPER, 8, 128)  # XQA pages are 16..128 tokens
    assert not use_xqa("auto", FP8, HOPPER, 16, 96)


def test_forcing_xqa_where_it_cannot_run_is_refused_and_fa2_never_uses_it() -> None:
    assert use_xqa("xqa", BF16, BLACKWELL, 32, 64)
    assert not use_xqa("fa2", FP8, HOPPER, 16, 128)
    assert not use_xqa("triton", FP8, HOPPER, 16, 128)  # the split-KV kernel instead
    with pytest.raises(ValueError, match="SM90/SM100/SM120"):
        use_xqa("xqa", FP8, AMPERE, 16, 128)
    with pytest.raises(ValueError, match="block size in"):
        use_xqa("xqa", FP8, HOPPER, 8, 128)


def test_the_environment_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DECODE_KERNEL_ENV, raising=False)
    assert decode_kernel_choice() == "auto"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "fa2")
    assert decode_kernel_choice() == "fa2"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "triton")
    assert decode_kernel_choice() == "triton"
    monkeypatch.setenv(DECODE_KERNEL_ENV, "fa3")
    with pytest.raises(ValueError, match=f"{DECODE_KERNEL_ENV} must be one of"):
        decode_kernel_choice()


def test_dense_page_table_pads_each_row_to_the_width() -> None:
    seqs = [SeqSpan(0, 1, 17, [7, 3, 9]), SeqSpan(1, 1, 16, [4, 8]), SeqSpan(2, 1, 1, [5])]
    # 17 tokens need 2 pages (the third block id is not part of the context yet)
    assert dense_page_table(seqs, 16, 3) == [7, 3, 0, 4, 0, 0, 5, 0, 0]


def test_leading_decode_rows_of_a_mixed_step() -> None:
    decode, prefill = SeqSpan(0, 1, 5, [1]), SeqSpan(1, 8, 8, [2])
    assert num_leading_decodes([decode, decode, prefill, decode]) == 2
    assert num_leading_decodes([prefill, decode]) == 0
    assert num_leading_decodes([decode, decode]) == 2


def test_prefill_chunks_take_fa3_only_on_hopper_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFILL_FA3_ENV, raising=False)
    assert prefill_backend(HOPPER) == "fa2"
    monkeypatch.setenv(PREFILL_FA3_ENV, "1")
    assert prefill_backend(HOPPER) == "fa3"
    assert prefill_backend(AMPERE) == "fa2"
    assert prefill_backend(BLACKWELL) == "fa2"  # FlashInfer's fa3 kernels are SM90's
    monkeypatch.setenv(PREFILL_FA3_ENV, "0")
    assert prefill_backend(HOPPER) == "fa2"


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


def test_ragged_backend_is_fa3_on_hopper_over_a_16_bit_cache_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PREFILL_RAGGED_ENV, raising=False)
    assert ragged_backend(HOPPER, BF16) == "fa3"
    assert ragged_backend(HOPPER, torch.float16) == "fa3"
    assert ragged_backend(HOPPER, FP8) is None  # slower beside FP8 GEMMs
    assert ragged_backend(AMPERE, BF16) is None  # fa2's ragged kernel: not measured
    monkeypatch.setenv(PREFILL_RAGGED_ENV, "auto")
    assert ragged_backend(HOPPER, BF16) == "fa3"


def test_ragged_backend_follows_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFILL_RAGGED_ENV, "1")
    assert ragged_backend(HOPPER, FP8) == "fa3"
    assert ragged_backend(AMPERE, BF16) == "fa2"
    monkeypatch.setenv(PREFILL_RAGGED_ENV, "fa2")
    assert ragged_backend(HOPPER, BF16) == "fa2"
    monkeypatch.setenv(PREFILL_RAGGED_ENV, "fa3")
    assert ragged_backend(HOPPER, FP8) == "fa3"
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        ragged_backend(AMPERE, BF16)
    monkeypatch.setenv(PREFILL_RAGGED_ENV, "0")
    assert ragged_backend(HOPPER, BF16) is None
    monkeypatch.setenv(PREFILL_RAGGED_ENV, "yes")
    with pytest.raises(ValueError, match="KVRELAY_PREFILL_RAGGED must be auto, 0, 1, fa2 or fa3"):
        ragged_backend(HOPPER, BF16)
