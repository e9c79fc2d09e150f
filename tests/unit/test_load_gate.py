"""LoadGate alone and in PrefixCache's match: a file tier's hits are read back while a read is
no slower than computing the block, passed over (computed again, counted by the tier) when it is
slower, save PROBE_BLOCKS of every PROBE_EVERY-th such match, with one log line each time a tier
turns slower or faster (not again the same way within SAY_EVERY_S)."""

from __future__ import annotations

import logging

from engine.kv_cache.disk_tier import DiskTier, Spill
from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.load_gate import (
    PROBE_BLOCKS,
    PROBE_EVERY,
    LoadGate,
    read_beats_compute,
)
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.tier_ops import tier_stats
from engine.step.request import Request
from tests.unit.test_disk_tier import DictFiles

BLOCK = 4


class Tier:
    def __init__(self, recent_load_s: float | None, name: str = "test tier") -> None:
        self.NAME = name
        self.recent_load_s = recent_load_s
        self.num_passed_over = 0


def test_a_tier_is_read_until_both_costs_are_measured() -> None:
    assert LoadGate(BLOCK, lambda: 0.0).blocks_to_read(Tier(1.0)) is None  # no rate yet
    assert LoadGate(BLOCK, lambda: 1e6).blocks_to_read(Tier(None)) is None  # no read yet


def test_a_slower_tier_is_passed_over_but_probed_and_said_once_a_way(caplog) -> None:
    rate = 16_000.0  # tokens/s: a 4-token block computes in 0.25 ms
    gate = LoadGate(BLOCK, lambda: rate)
    assert read_beats_compute(0.2e-3, rate, BLOCK) and not read_beats_compute(1e-3, rate, BLOCK)
    fast, slow = Tier(0.2e-3), Tier(1e-3)
    assert gate.blocks_to_read(fast) is None
    with caplog.at_level(logging.INFO, logger="engine.kv_cache.load_gate"):
        answers = [gate.blocks_to_read(slow) for _ in range(2 * PROBE_EVERY)]
        assert answers.count(PROBE_BLOCKS) == 2 and answers[PROBE_EVERY - 1] == PROBE_BLOCKS
        assert answers.count(0) == 2 * PROBE_EVERY - 2  # the rest: none read
        assert slow.num_passed_over == 2 * PROBE_EVERY
        assert caplog.text.count("slower than computing") == 1
        assert gate.blocks_to_read(fast) is None  # faster: read, and said at once
        assert caplog.text.count("no slower than computing") == 1
        assert gate.blocks_to_read(slow) == 0  # slower again within a minute: not said again
        assert caplog.text.count("is slower than computing") == 1
    assert gate.num_asked == 2 * PROBE_EVERY + 3 and fast.num_passed_over == 0


def test_each_tier_is_probed_on_its_own_count() -> None:
    gate = LoadGate(BLOCK, lambda: 1e12)
    disk, shared = Tier(1e-3), Tier(1e-3, "other tier")
    probes = {"disk": 0, "shared": 0}
    for _ in range(PROBE_EVERY):
        probes["disk"] += gate.blocks_to_read(disk) == PROBE_BLOCKS
        probes["shared"] += gate.blocks_to_read(shared) == PROBE_BLOCKS
    assert probes == {"disk": 1, "shared": 1}


def test_a_match_stops_at_a_disk_tier_slower_than_computing() -> None:
    """The prompt's blocks are only on disk: read back under a slow compute rate, taken when
    already read, passed over (counted in the tier's figures) under a fast rate, and a probe
    reads PROBE_BLOCKS of them."""
    files = DictFiles()
    disk = DiskTier(64, files)
    kv = KVCacheManager(8, BLOCK, "m", disk_tier=disk)
    prompt = list(range(1, 4 * BLOCK + 2))
    hashes = hash_blocks(prompt, BLOCK, "m")
    for h in hashes:
        assert disk.put(Spill(h, 0, True, 35), f"kv{h}")
    rate = [1.0]  # tokens/s: computing a block takes 4 s, any read is faster
    gate = kv.prefix.gate = LoadGate(BLOCK, lambda: rate[0])

    def copied_in() -> None:
        for h in hashes[:4]:
            if disk.is_staged(h):
                assert disk.take(h) == f"kv{h}"  # on disk only again

    first = kv.match_prefix(Request("a", prompt))
    assert first.disk_hashes == tuple(hashes[:4])  # read at match time (no reader thread)
    assert disk.recent_load_s is not None and gate.num_asked == 1
    rate[0] = 1e12  # a block computes in picoseconds: every read is slower
    again = kv.match_prefix(Request("b", prompt))  # but they are read already: taken
    assert again.disk_hashes == tuple(hashes[:4]) and gate.num_asked == 1
    copied_in()
    matches = [kv.match_prefix(Request(f"c{i}", prompt)) for i in range(PROBE_EVERY)]
    assert [m.disk_hashes for m in matches[:-1]] == [()] * (PROBE_EVERY - 1)
    assert matches[-1].disk_hashes == tuple(hashes[:PROBE_BLOCKS])  # the probe
    assert disk.num_passed_over == PROBE_EVERY
    (disk_figures,) = [t for t in tier_stats(kv, 64) if t.tier == "disk"]
    assert disk_figures.passed_over == PROBE_EVERY
    kv.check_integrity()
