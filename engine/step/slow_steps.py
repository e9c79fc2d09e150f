"""SlowSteps: a step far slower than the engine's recent ones, said on stderr with what it
carried (at most one line every SAY_EVERY_S); owns the count of such steps and when it last
said one.

A served request's TTFT tail is made of a few slow steps; this line names them where the server
log is kept (bench/served_goodput.sh keeps it beside each run), so a tail can be read as "this
step, carrying these prompts, took this long" without a profiler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.say import say
from engine.step.scheduler import ScheduledChunk

SLOW_FACTOR = 4.0  # a step slower than this many times what its tokens usually take
MIN_SLOW_S = 0.05  # and slower than this
SAY_EVERY_S = 10.0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def composition(chunks: Sequence[ScheduledChunk]) -> str:
    """What a step carried: its prompt chunks (new tokens, tokens before them) and decodes."""
    prompts = [c for c in chunks if c.is_prompt]
    decodes = _count(len(chunks) - len(prompts), "decode")
    if not prompts:
        return decodes
    num_new = sum(c.num_new_tokens for c in prompts)
    num_before = sum(c.start for c in prompts)
    return (
        f"{_count(len(prompts), 'prompt chunk')} ({_count(num_new, 'new token')} after "
        f"{num_before} computed or cached), {decodes}"
    )


class SlowSteps:
    def __init__(self, model: str = "", say_line: Callable[[str], None] = say) -> None:
        """model: named in the line (a speculative worker's draft engine steps too)."""
        self.num_slow = 0
        self._say = say_line
        self._of = f" of {model}" if model else ""
        self._said_at: float | None = None

    def observe(
        self, seconds: float, num_tokens: int, mean_step_s: float, tokens_per_s: float,
        chunks: Sequence[ScheduledChunk],
    ) -> bool:  # fmt: skip
        """One step that took `seconds` for num_tokens, against the recent mean step time and
        token rate (0: none yet); True when it counts as slow. With overlapped steps `seconds`
        is the step() call: waiting for this step's tokens and launching the next one."""
        if mean_step_s <= 0 or tokens_per_s <= 0:
            return False
        usual = max(mean_step_s, num_tokens / tokens_per_s)
        if seconds < max(MIN_SLOW_S, SLOW_FACTOR * usual):
            return False
        self.num_slow += 1
        now = time.monotonic()
        if self._said_at is None or now - self._said_at >= SAY_EVERY_S:
            self._said_at = now
            self._say(
                f"slow step{self._of}: {seconds * 1e3:.0f} ms against ~{usual * 1e3:.0f} ms "
                f"usual for its {_count(num_tokens, 'token')}: {composition(chunks)} "
                f"({self.num_slow} slow so far)"
            )
        return True
