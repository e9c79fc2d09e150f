"""LoadGate: whether a prefix hit in a file tier (the disk tier, the cluster-shared store) is
worth reading back, or its tokens are cheaper to compute again; owns the count of hits it let
go and whether it said so. Torch-free.

A block read back costs the tier's recent read time (one reader thread reads a request's blocks
one after another); computed again it costs block_size tokens at the rate of the engine's recent
steps. On an H100 with the 8B shape the disk tier read a 2 MiB block in ~1.6 ms while the engine
computed its 16 tokens in ~0.4 ms: loading 1,008 hit blocks took a prompt's TTFT from 70 to
280 ms. A tier slower than computing is passed over, except every PROBE_EVERY-th hit it would
have been, which still loads and so keeps the tier's read time measured (the disk or the
compute rate may change). Routers price a disk hit by the same comparison (router/policy.py
disk_credit).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

PROBE_EVERY = 16


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
        self.num_passed_over = 0  # hits computed again because reading was slower
        self._slower: dict[str, bool] = {}  # tier name -> what the log last said

    def worth_reading(self, tier: ReadCost) -> bool:
        """Whether to read this tier's hits back for the match being made (True until both
        costs are measured)."""
        read_s, rate = tier.recent_load_s, self.tokens_per_s()
        if read_s is None or rate <= 0:
            return True
        faster = read_beats_compute(read_s, rate, self.block_size)
        self._say(tier.NAME, read_s, self.block_size / rate, slower=not faster)
        if faster:
            return True
        self.num_passed_over += 1
        return self.num_passed_over % PROBE_EVERY == 0

    def _say(self, name: str, read_s: float, compute_s: float, slower: bool) -> None:
        """One log line each time a tier turns slower or faster than computing."""
        if self._slower.get(name, False) == slower:
            return
        self._slower[name] = slower
        if slower:
            log.warning(
                "%s: reading a block back (%.2f ms) is slower than computing its tokens "
                "(%.2f ms): prompts compute those blocks again (one hit in %d still reads, to "
                "keep measuring)",
                name, read_s * 1e3, compute_s * 1e3, PROBE_EVERY,
            )  # fmt: skip
        else:
            log.info(
                "%s: reading a block back (%.2f ms) is no slower than computing it (%.2f ms) "
                "again: hits are read back",
                name, read_s * 1e3, compute_s * 1e3,
            )  # fmt: skip
