"""LoadGate: whether a prefix hit in a file tier (the disk tier, the cluster-shared store) is worth
reading back, or its tokens are cheaper to compute again; owns the count of matches it was asked
about and when it last said what of each tier (a tier counts its own matches passed over).
Torch-free.

A block read back costs the tier's recent read time (one reader thread reads a request's blocks
one after another); computed again it costs block_size tokens at the engine's recent prefill
rate (its steps that were mostly prompt tokens). On an H100 with the 8B shape the disk tier read
a 2 MiB block in ~1.6 ms while the engine computed its 16 tokens in ~0.4 ms: loading 1,008 hit
blocks took a prompt's TTFT from 70 to 280 ms. A tier slower than computing is passed over (the
match stops at its first block not read yet; blocks already read are taken), except every
PROBE_EVERY-th match it would have been passed over in, which reads PROBE_BLOCKS and so keeps
the tier's read time measured (the disk or the compute rate may change). Routers price a disk
hit by a like comparison (router/policy.py tier_credit: the worker's published read time of that
tier against the same prompt rate).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

PROBE_EVERY = 16
PROBE_BLOCKS = 2  # what a probe reads: enough to measure, not a whole prefix's wait
SAY_EVERY_S = 60.0


class ReadCost(Protocol):
    NAME: str
    num_passed_over: int  # matches whose hits here were computed again (the tier's counter)

    @property
    def recent_load_s(self) -> float | None: ...


def read_beats_compute(read_s: float, tokens_per_s: float, block_size: int) -> bool:
    """Whether reading a block back (read_s) takes no longer than computing its block_size
    tokens at tokens_per_s."""
    return read_s * tokens_per_s <= block_size


class LoadGate:
    def __init__(self, block_size: int, prefill_tok_s: Callable[[], float]):
        """prefill_tok_s: the engine's recent rate over steps that were mostly prompt tokens
        (0: not measured yet; decode steps would make computing look slow)."""
        self.block_size = block_size
        self.prefill_tok_s = prefill_tok_s
        self.num_asked = 0  # matches that met a hit not read yet in a file tier
        self._last: dict[str, bool] = {}  # tier -> the turn last said (True: slower)
        self._said_at: dict[tuple[str, bool], float] = {}  # (tier, slower?) -> when said

    def blocks_to_read(self, tier: ReadCost) -> int | None:
        """How many of this tier's hits not read yet the match being made reads back: None
        (all of them) while reading is no slower than computing or a cost is not measured yet;
        else 0, or PROBE_BLOCKS for every PROBE_EVERY-th such match (it keeps the read time
        measured). A match passed over counts in the tier's num_passed_over."""
        self.num_asked += 1
        read_s, rate = tier.recent_load_s, self.prefill_tok_s()
        if read_s is None or rate <= 0:
            return None
        faster = read_beats_compute(read_s, rate, self.block_size)
        self._say(tier.NAME, read_s, self.block_size / rate, slower=not faster)
        if faster:
            return None
        tier.num_passed_over += 1
        return PROBE_BLOCKS if tier.num_passed_over % PROBE_EVERY == 0 else 0

    def _say(self, name: str, read_s: float, compute_s: float, slower: bool) -> None:
        """One log line when a tier turns slower or faster than computing; a turn the same
        way as one said less than SAY_EVERY_S ago waits (near the threshold it may turn at
        every match): at most two lines a tier a minute."""
        if self._last.get(name, False) == slower:
            return
        now = time.monotonic()
        if now - self._said_at.get((name, slower), -math.inf) < SAY_EVERY_S:
            return
        self._last[name] = slower
        self._said_at[(name, slower)] = now
        if slower:
            log.warning(
                "%s: reading a block back (%.2f ms) is slower than computing its tokens "
                "(%.2f ms): prompts compute those blocks again (one such match in %d still "
                "reads %d blocks, to keep measuring)",
                name, read_s * 1e3, compute_s * 1e3, PROBE_EVERY, PROBE_BLOCKS,
            )  # fmt: skip
        else:
            log.warning(
                "%s: reading a block back (%.2f ms) is no slower than computing it (%.2f ms) "
                "again: hits are read back",
                name, read_s * 1e3, compute_s * 1e3,
            )  # fmt: skip
