"""Retention by token range (a request's `kv_retention`): the range type, its validation (an
error naming the field), and the per-block priority and expiry it gives a request's blocks when
they are freed. Pure and torch-free; owns no state.

A range covers token positions [start, end) of the request's sequence (prompt then output; end
None: to the end). A block takes the highest priority among the ranges that overlap it, else
the request's default; a range with duration_s keeps its priority for that long after the block
is freed, then the block falls back to the default. A range may set a priority below the
default (evicted first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

MIN_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY = 0, 100
MAX_RETENTION_RANGES = 16


@dataclass(frozen=True)
class RetentionRange:
    """Token positions [start, end) whose blocks keep `priority` (0-100) for duration_s."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None


class InvalidRetention(ValueError):
    """A kv_retention entry the server cannot honour; `field` names it (kv_retention[i].end)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def check_ranges(ranges: Sequence[RetentionRange], param: str = "kv_retention") -> None:
    """Raise InvalidRetention naming the first bad field."""
    if len(ranges) > MAX_RETENTION_RANGES:
        raise InvalidRetention(
            f"{param}: at most {MAX_RETENTION_RANGES} ranges, got {len(ranges)}", param
        )
    for i, r in enumerate(ranges):
        where = f"{param}[{i}]"
        if not isinstance(r.start, int) or r.start < 0:
            raise InvalidRetention(f"{where}.start must be an integer >= 0", f"{where}.start")
        if r.end is not None and (not isinstance(r.end, int) or r.end <= r.start):
            raise InvalidRetention(
                f"{where}.end must be an integer > start ({r.start}) or null", f"{where}.end"
            )
        if not isinstance(r.priority, int) or not (
            MIN_RETENTION_PRIORITY <= r.priority <= MAX_RETENTION_PRIORITY
        ):
            raise InvalidRetention(
                f"{where}.priority must be an integer in [{MIN_RETENTION_PRIORITY}, "
                f"{MAX_RETENTION_PRIORITY}]",
                f"{where}.priority",
            )
        if r.duration_s is not None and not (math.isfinite(r.duration_s) and r.duration_s > 0):
            raise InvalidRetention(
                f"{where}.duration_s must be a number > 0 or null", f"{where}.duration_s"
            )


def block_retention(
    ranges: Sequence[RetentionRange],
    num_blocks: int,
    block_size: int,
    default_priority: int,
    now: float,
) -> list[tuple[int, float | None]]:
    """(priority, expires_at or None) for each of a request's first num_blocks blocks.

    expires_at is `now + duration_s` of the range that set the priority (None: it does not
    expire); a block no range overlaps gets (default_priority, None)."""
    out: list[tuple[int, float | None]] = []
    for i in range(num_blocks):
        lo, hi = i * block_size, (i + 1) * block_size
        best: tuple[int, float | None] | None = None
        for r in ranges:
            overlaps = r.start < hi and (r.end is None or r.end > lo)
            if overlaps and (best is None or r.priority > best[0]):
                best = (r.priority, None if r.duration_s is None else now + r.duration_s)
        out.append(best or (default_priority, None))
    return out
