"""The decode graphs' padded static input rows, and the captured size a step runs at
(engine/execution/step_inputs.py)."""

from __future__ import annotations

from engine.execution.step_inputs import padded_rows, smallest_fit


def test_padded_rows_fill_a_graphs_static_inputs() -> None:
    rows = padded_rows([5, 6], [10, 11], [3, 3], [10, 11], 4, pad_block_id=99)
    assert rows.tolist() == [[5, 6, 0, 0], [10, 11, 0, 0], [3, 3, 99, 99], [10, 11, 0, 0]]


def test_a_step_runs_at_the_smallest_captured_size_that_holds_it() -> None:
    sizes = [16, 32, 64, 100]
    assert [smallest_fit(sizes, n) for n in (1, 16, 17, 64, 65, 100)] == [16, 16, 32, 64, 100, 100]
    assert smallest_fit(sizes, 101) is None
