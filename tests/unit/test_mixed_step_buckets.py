"""The token buckets of the piecewise mixed-step graphs (engine/mixed_step_graphs.py): powers of
two from 16, then the step budget itself, so every step of the scheduler has a bucket."""

from __future__ import annotations

import pytest

from engine.mixed_step_graphs import token_buckets


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
