"""LoadGate: whether a prefix hit in a file tier (the disk tier, the cluster-shared store) is
worth reading back, or its tokens are cheaper to compute again; owns its counts (matches
asked, matches passed over by tier) and what it last said of each tier. Torch-free.

A block read back costs the tier's recent read time (one reader thread reads a request's blocks
one after another); computed again it costs block_size tokens at the rate of the engine's recent
steps. On an H100 with the 8B shape the disk tier read a 2 MiB block in ~1.6 ms while the engine
computed its 16 tokens in ~0.4 ms: loading 1,008 hit blocks took a prompt's TTFT from 70 to
280 ms. A tier slower than computing is passed over (the match stops at its first block not
read yet; blocks already read are taken), except every PROBE_EVERY-th match it would have been
passed over in, which still reads and so keeps the tier's read time measured (the disk or the
compute rate may change). Routers price a disk hit by a like comparison (router/policy.py
disk_credit: the worker's mean read time against its token rate).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

PROBE_EVERY = 16
SAY_EVERY_S = 60.0


class ReadCost(Protocol):
    NAME: str

    @property
    def recent_load_s(self) -> float | None: ...


def read_beats_compute(read_s: float, tokens_per_s: float, block_size: int) -> bool:
    """Whether reading a block back (read_s) takes no longer than computing its block_size
    tokens at tokens_per_s."""
    return read_s * tokens_per_s <= block_size


class LoadGate:
    def __init__(self, block_size: int, tokens_per_s: Callable[[], float]):
        """tokens_per_s: the engine's recent compute rate (0: not measured yet)."""
        self.block_size = block_size
        self.tokens_per_s = tokens_per_s
        self.num_asked = 0  # matches that met a hit not read yet in a file tier
        self._passed_over: dict[str, int] = {}  # tier name -> its hits computed again
        self._said: dict[str, tuple[bool, float]] = {}  # tier -> (slower?, when) last said

    @property
    def num_passed_over(self) -> int:
        """Matches whose file tier hits were computed again, reading being the slower."""
        return sum(self._passed_over.values())

    def worth_reading(self, tier: ReadCost) -> bool:
        """Whether to read this tier's hits back for the match being made (True until both
        costs are measured)."""
        self.num_asked += 1
        read_s, rate = tier.recent_load_s, self.tokens_per_s()
        if read_s is None or rate <= 0:
            return True
        faster = read_beats_compute(read_s, rate, self.block_size)
        self._say(tier.NAME, read_s, self.block_size / rate, slower=not faster)
        if faster:
            return True
        passed = self._passed_over[tier.NAME] = self._passed_over.get(tier.NAME, 0) + 1
        return passed % PROBE_EVERY == 0

    def _say(self, name: str, read_s: float, compute_s: float, slower: bool) -> None:
        """One log line when a tier turns slower or faster than computing, at most one a tier
        every SAY_EVERY_S (near the threshold it may turn at every match)."""
        said, when = self._said.get(name, (False, -math.inf))
        now = time.monotonic()
        if said == slower or now - when < SAY_EVERY_S:
            return
        self._said[name] = (slower, now)
        if slower:
            log.warning(
                "%s: reading a block back (%.2f ms) is slower than computing its tokens "
                "(%.2f ms): prompts compute those blocks again (one such match in %d still "
                "reads, to keep measuring)",
                name, read_s * 1e3, compute_s * 1e3, PROBE_EVERY,
            )  # fmt: skip
        else:
            log.warning(
                "%s: reading a block back (%.2f ms) is no slower than computing it (%.2f ms) "
                "again: hits are read back",
                name, read_s * 1e3, compute_s * 1e3,
            )  # fmt: skip
