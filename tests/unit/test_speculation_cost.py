"""CostGuard: speculation is kept where it is cheaper per token, dropped where it is dearer,
and measured again after each hold."""

from __future__ import annotations

from engine.speculation.speculation_cost import CostGuard


def run(guard: CostGuard, steps: int, spec_s: float, plain_s: float) -> list[bool]:
    modes = []
    for _ in range(steps):
        modes.append(guard.speculating)
        guard.observe(spec_s if guard.speculating else plain_s, 1)
    return modes


def test_cheaper_speculation_is_kept_between_measures():
    guard = CostGuard(window=4, hold=20)
    modes = run(guard, 8 + 20, spec_s=0.5, plain_s=1.0)
    assert modes[:4] == [True] * 4 and modes[4:8] == [False] * 4  # measure both
    assert modes[8:] == [True] * 20  # then hold the cheaper
    assert guard.cost == {True: 0.5, False: 1.0}
    assert run(guard, 4, 0.5, 1.0) == [False] * 4  # after the hold: plain measured again
    assert guard.speculating


def test_dearer_speculation_steps_aside_and_is_tried_again():
    guard = CostGuard(window=4, hold=20)
    modes = run(guard, 8 + 20, spec_s=2.0, plain_s=1.0)
    assert modes[8:] == [False] * 20
    # later speculation pays (say the text began to repeat): tried again after the hold
    assert run(guard, 4, 0.5, 1.0) == [True] * 4
    assert guard.speculating and guard.cost[True] == 0.5


def test_steps_without_tokens_are_not_counted():
    guard = CostGuard(window=2, hold=5)
    guard.observe(9.0, 0)
    guard.observe(1.0, 1)
    assert guard.speculating  # one counted step of two
    guard.observe(1.0, 1)
    assert not guard.speculating
