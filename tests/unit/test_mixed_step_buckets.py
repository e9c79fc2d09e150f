"""The token buckets of the piecewise mixed-step graphs (engine/mixed_step_graphs.py): powers of
two from 16, then the step budget itself, so every step of the scheduler has a bucket; and the
padded static input rows both graph kinds upload."""

from __future__ import annotations

import pytest

from engine.mixed_step_graphs import token_buckets
from engine.step_inputs import padded_rows, smallest_fit


@pytest.mark.parametrize(
    ("budget", "want"),
    [
        (8192, [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]),
        (100, [16, 32, 64, 100]),
        (16, [16]),
        (10, [10]),
    ],
)
def test_buckets_double_up_to_the_step_budget(budget: int, want: list[int]) -> None:
    assert token_buckets(budget) == want


def test_padded_rows_fill_a_graphs_static_inputs() -> None:
    rows = padded_rows([5, 6], [10, 11], [3, 3], [10, 11], 4, pad_block_id=99)
    assert rows.tolist() == [[5, 6, 0, 0], [10, 11, 0, 0], [3, 3, 99, 99], [10, 11, 0, 0]]


def test_a_step_runs_at_the_smallest_captured_size_that_holds_it() -> None:
    sizes = token_buckets(100)
    assert [smallest_fit(sizes, n) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]
    assert smallest_fit(sizes, 101) is None
