"""A request's scheduling priority: its range and the check of one value. Holds no state.

Higher runs first: the router's queue serves a higher priority before a lower one, and an
engine admits a waiting request of higher priority first and may preempt running requests of
lower priority for its blocks (engine/step/scheduler.py). 0 is the default.
"""

from __future__ import annotations

from engine.sampling.validation import InvalidField

# Scheduling levels (not block_pool's retention priorities, which are 0..100 and default 35)
MIN_LEVEL = -100
MAX_LEVEL = 100
DEFAULT_LEVEL = 0


def check_priority(priority: object, field: str = "priority") -> int:
    """The priority as an int; InvalidField naming `field` unless an int in the range."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidField(f"{field} must be an integer, got {priority!r}", field)
    if not MIN_LEVEL <= priority <= MAX_LEVEL:
        raise InvalidField(
            f"{field} must be in [{MIN_LEVEL}, {MAX_LEVEL}] (higher runs first), got {priority}",
            field,
        )
    return priority
