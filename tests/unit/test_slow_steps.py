"""SlowSteps alone: a step far slower than the recent ones is counted and said with what it
carried, at most one line every SAY_EVERY_S; usual steps, and any before a rate is known, are
not."""

from __future__ import annotations

from engine.step.request import Request
from engine.step.scheduler import ScheduledChunk
from engine.step.slow_steps import MIN_SLOW_S, SlowSteps, composition


def chunks() -> list[ScheduledChunk]:
    prompt = Request("p", list(range(1, 301)))  # 300 prompt tokens, 100 computed or cached
    decode = Request("d", list(range(1, 11)), output_token_ids=[5])
    return [ScheduledChunk(prompt, 100, 200, True), ScheduledChunk(decode, 11, 1, True)]


def test_a_slow_step_is_said_with_what_it_carried_once_a_while() -> None:
    lines: list[str] = []
    slow = SlowSteps("tiny", lines.append)
    assert composition(chunks()) == (
        "1 prompt chunk (200 new tokens after 100 computed or cached), 1 decode"
    )
    assert composition(chunks()[1:]) == "1 decode"
    assert not slow.observe(0.3, 201, 0.0, 0.0, chunks())  # nothing known yet
    assert not slow.observe(0.02, 201, 0.015, 30_000.0, chunks())  # usual
    assert not slow.observe(0.04, 201, 0.008, 30_000.0, chunks())  # 5x, but under MIN_SLOW_S
    assert MIN_SLOW_S > 0.04
    assert slow.observe(0.3, 201, 0.015, 30_000.0, chunks())
    assert slow.observe(0.4, 201, 0.015, 30_000.0, chunks())  # counted, not said again yet
    assert slow.num_slow == 2 and len(lines) == 1
    assert lines[0].startswith("slow step of tiny: 300 ms")
    assert "201 tokens: 1 prompt chunk (200 new" in lines[0]
    # a big prompt's step is slow only against what its tokens usually take
    assert not slow.observe(0.3, 8192, 0.015, 30_000.0, chunks())
