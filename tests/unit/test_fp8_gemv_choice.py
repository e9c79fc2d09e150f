"""The FP8 GEMV's kernel choice by input rows (KVRELAY_FP8_GEMV_VECTOR_ROWS): read on the CPU,
no kernel runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.quant.fp8_gemv import (
    VECTOR_MAX_ROWS,
    VECTOR_ROWS_DEFAULT,
    VECTOR_ROWS_ENV,
    kernel_for,
    vector_rows,
)


@pytest.fixture
def fresh_choice() -> Iterator[None]:
    vector_rows.cache_clear()
    yield
    vector_rows.cache_clear()


def test_default_choice(fresh_choice: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VECTOR_ROWS_ENV, raising=False)
    assert vector_rows() == VECTOR_ROWS_DEFAULT
    assert kernel_for(VECTOR_ROWS_DEFAULT + 1) == "dot"


def test_rows_up_to_the_setting_take_the_vector_kernel(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(VECTOR_ROWS_ENV, str(VECTOR_MAX_ROWS))
    assert [kernel_for(r) for r in range(1, VECTOR_MAX_ROWS + 2)] == [
        "vector"
    ] * VECTOR_MAX_ROWS + ["dot"]
    vector_rows.cache_clear()
    monkeypatch.setenv(VECTOR_ROWS_ENV, "0")
    assert kernel_for(1) == "dot"


@pytest.mark.parametrize("raw", ["3", "-1", "one", ""])
def test_a_bad_setting_is_refused_by_name(
    fresh_choice: None, monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(VECTOR_ROWS_ENV, raw)
    with pytest.raises(ValueError, match=VECTOR_ROWS_ENV):
        vector_rows()
