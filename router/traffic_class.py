"""Traffic classes: what an API key's `class=` and `weight=` options mean (interactive or batch,
its share of the router's queue) and the priority a request of a class runs at. Holds no state.

- interactive (the default): the request's own `priority` (default 0), its TTFT objective
  applies (router/slo.py).
- batch: its priority is capped at BATCH_MAX_PRIORITY (below an interactive request's default).
  It may carry a deadline (`deadline_s`) instead of the TTFT objective: a request with one is
  placed whatever the TTFT objective says (router/placement.py), and still queued in the
  router that long after arrival it is refused (503, code "deadline_exceeded"; gRPC
  DEADLINE_EXCEEDED). With API keys only a batch key may send deadline_s (an interactive one
  is refused: check_deadline); with keys off any request may.
- weight: the flow's quantum in the router's deficit round robin (router/fair_queue.py): two
  tenants of one priority that both keep the queue full are served queued tokens in the
  proportion of their weights.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from engine.priority import DEFAULT_LEVEL, check_priority
from engine.sampling.validation import InvalidField
from router.errors import InvalidRequest

BATCH_MAX_PRIORITY = -1
MAX_WEIGHT = 1000


class TrafficClass(enum.Enum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


@dataclass(frozen=True)
class KeyClass:
    """A key's (a tenant's) class and fair-share weight."""

    kind: TrafficClass = TrafficClass.INTERACTIVE
    weight: int = 1

    def priority(self, requested: int | None) -> int:
        """The priority a request of this class runs at (requested: already range-checked)."""
        if self.kind is TrafficClass.BATCH:
            return min(BATCH_MAX_PRIORITY if requested is None else requested, BATCH_MAX_PRIORITY)
        return DEFAULT_LEVEL if requested is None else requested


DEFAULT_CLASS = KeyClass()
MAX_DEADLINE_S = 7 * 24 * 3600.0


def request_priority(key_class: KeyClass, requested: object) -> int:
    """The priority a request runs at: its own (None: the class's default), range-checked
    (InvalidRequest naming `priority`), capped by its class."""
    if requested is None:
        return key_class.priority(None)
    try:
        return key_class.priority(check_priority(requested))
    except InvalidField as e:
        raise InvalidRequest(e.message, "priority") from None


def check_deadline(deadline_s: object, key_class: KeyClass | None = None) -> float | None:
    """A request's deadline_s (seconds after arrival, > 0); InvalidRequest naming it otherwise,
    or when the API key's class (key_class; None: keys off) is not batch: a deadline replaces
    the TTFT objective, which interactive keys may not skip."""
    if deadline_s is None:
        return None
    if key_class is not None and key_class.kind is not TrafficClass.BATCH:
        raise InvalidRequest(
            f"deadline_s is for batch-class API keys (it replaces the TTFT objective); this "
            f"key's class is {key_class.kind.value}",
            "deadline_s",
        )
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
        raise InvalidRequest(
            f"deadline_s must be a number of seconds, got {deadline_s!r}", "deadline_s"
        )
    if not 0 < deadline_s <= MAX_DEADLINE_S:  # NaN too
        raise InvalidRequest(
            f"deadline_s must be in (0, {MAX_DEADLINE_S:g}] seconds, got {deadline_s}",
            "deadline_s",
        )
    return float(deadline_s)


OPTIONS = ("class", "weight")


def key_class(options: Mapping[str, str]) -> KeyClass:
    """The KeyClass of a key line's `class=` / `weight=` options (absent: the default's);
    ValueError saying which value is wrong."""
    kind = options.get("class", DEFAULT_CLASS.kind.value)
    try:
        traffic = TrafficClass(kind)
    except ValueError:
        names = " or ".join(c.value for c in TrafficClass)
        raise ValueError(f"class={kind!r}: the class is {names}") from None
    text = options.get("weight", str(DEFAULT_CLASS.weight))
    try:
        weight = int(text)
    except ValueError:
        weight = 0
    if not 1 <= weight <= MAX_WEIGHT:
        raise ValueError(f"weight={text!r}: the weight is an integer in [1, {MAX_WEIGHT}]")
    return KeyClass(traffic, weight)
