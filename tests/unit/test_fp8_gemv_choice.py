"""The FP8 GEMV's kernel choice by input rows (one row on the vector kernel, more on the dot
one): read on the CPU, no kernel runs."""

from __future__ import annotations

from engine.quant.fp8_gemv import VECTOR_ROWS, kernel_for


def test_one_row_takes_the_vector_kernel_more_the_dot_one() -> None:
    assert VECTOR_ROWS == 1
    assert kernel_for(1) == "vector"
    assert kernel_for(VECTOR_ROWS + 1) == "dot"
    assert kernel_for(16) == "dot"
