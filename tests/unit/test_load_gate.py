"""LoadGate alone and in PrefixCache's match: a file tier's hits are read back while a read is
no slower than computing the block, passed over (computed again) when it is slower, save every
PROBE_EVERY-th such hit, with one log line each time a tier turns slower or faster."""

from __future__ import annotations

import logging

from engine.kv_cache.disk_tier import DiskTier, Spill
from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.load_gate import PROBE_EVERY, LoadGate, read_beats_compute
from engine.kv_cache.manager import KVCacheManager
from engine.step.request import Request
from tests.unit.test_disk_tier import DictFiles

BLOCK = 4


class Tier:
    NAME = "test tier"

    def __init__(self, recent_load_s: float | None) -> None:
        self.recent_load_s = recent_load_s


def test_a_tier_is_read_until_both_costs_are_measured() -> None:
    assert LoadGate(BLOCK, lambda: 0.0).worth_reading(Tier(1.0))  # no compute rate yet
    assert LoadGate(BLOCK, lambda: 1e6).worth_reading(Tier(None))  # no read yet


def test_a_slower_tier_is_passed_over_but_probed_and_said_once(caplog) -> None:
    rate = 16_000.0  # tokens/s: a 4-token block computes in 0.25 ms
    gate = LoadGate(BLOCK, lambda: rate)
    assert read_beats_compute(0.2e-3, rate, BLOCK) and not read_beats_compute(1e-3, rate, BLOCK)
    assert gate.worth_reading(Tier(0.2e-3))
    with caplog.at_level(logging.INFO, logger="engine.kv_cache.load_gate"):
        answers = [gate.worth_reading(Tier(1e-3)) for _ in range(2 * PROBE_EVERY)]
        assert answers.count(True) == 2 and answers[PROBE_EVERY - 1]  # the probes
        assert caplog.text.count("slower than computing") == 1
        assert gate.worth_reading(Tier(0.1e-3))  # faster again: read, not said so soon
        assert "no slower than computing" not in caplog.text
    assert gate.num_passed_over == 2 * PROBE_EVERY and gate.num_asked == 2 * PROBE_EVERY + 2


def test_a_match_stops_at_a_disk_tier_slower_than_computing() -> None:
    """The prompt's blocks are only on disk: read back under a slow compute rate, computed
    (no disk blocks in the match) under a fast one."""
    files = DictFiles()
    disk = DiskTier(64, files)
    kv = KVCacheManager(8, BLOCK, "m", disk_tier=disk)
    prompt = list(range(1, 4 * BLOCK + 2))
    hashes = hash_blocks(prompt, BLOCK, "m")
    for h in hashes:
        assert disk.put(Spill(h, 0, True, 35), f"kv{h}")
    rate = [1.0]  # tokens/s: computing a block takes 4 s, any read is faster
    kv.prefix.gate = LoadGate(BLOCK, lambda: rate[0])
    first = kv.match_prefix(Request("a", prompt))
    assert first.disk_hashes == tuple(hashes[:4])  # read at match time (no reader thread)
    assert disk.recent_load_s is not None and kv.prefix.gate.num_asked == 1
    rate[0] = 1e12  # a block computes in picoseconds: every read is slower
    again = kv.match_prefix(Request("b", prompt))  # but they are read already: taken
    assert again.disk_hashes == tuple(hashes[:4]) and kv.prefix.gate.num_asked == 1
    for h in hashes[:4]:
        assert disk.take(h) == f"kv{h}"  # copied in: on disk only again
    second = kv.match_prefix(Request("c", prompt))
    assert second.disk_hashes == () and second.num_tokens == 0
    assert kv.prefix.gate.num_asked == 2 and kv.prefix.gate.num_passed_over == 1
    kv.check_integrity()


def test_each_tier_is_probed_on_its_own_count() -> None:
    gate = LoadGate(BLOCK, lambda: 1e12)
    disk, shared = Tier(1e-3), Tier(1e-3)
    shared.NAME = "other tier"
    probes = {"disk": 0, "shared": 0}
    for _ in range(PROBE_EVERY):
        probes["disk"] += gate.worth_reading(disk)
        probes["shared"] += gate.worth_reading(shared)
    assert probes == {"disk": 1, "shared": 1}
