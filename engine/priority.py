"""A request's scheduling priority: its range and the check of one value. Holds no state.

Higher runs first: the router's queue serves a higher priority before a lower one, and an
engine admits a waiting request of higher priority first and may preempt running requests of
lower priority for its blocks (engine/step/scheduler.py). 0 is the default.
"""

from __future__ import annotations

from engine.sampling.validation import InvalidField

MIN_PRIORITY = -100
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 0


def check_priority(priority: object, field: str = "priority") -> int:
    """The priority as an int; InvalidField naming `field` unless an int in the range."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidField(f"{field} must be an integer, got {priority!r}", field)
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidField(
            f"{field} must be in [{MIN_PRIORITY}, {MAX_PRIORITY}] (higher runs first), "
            f"got {priority}",
            field,
        )
    return priority
