"""TierStats: one KV tier's size, use, hits and loads as an engine counted them (device, host,
disk, shared), the one record status, /metrics and the bench read. Owns no state: a value built
by tier_ops.tier_stats from the tiers' own counters. Torch-free (the router imports it).

Hit rate: a tier's hit blocks over the prompt blocks looked up in it; a prompt's full blocks are
looked up in the device pool, those it lacks in the host tier, then the disk tier, then the
shared store (counted once a request is first given blocks).
"""

from __future__ import annotations

from typing import NamedTuple

TIERS = ("device", "host", "disk", "shared")


class TierStats(NamedTuple):
    tier: str  # one of TIERS
    capacity_blocks: int  # its bound (the shared store's: all workers' together)
    used_blocks: int  # blocks it holds now (device: in use or cached; shared: the last count)
    lookup_blocks: int  # prompt blocks looked up in it
    hit_blocks: int  # of those, found here (and loaded, past the device)
    load_bytes: int  # KV bytes loaded from it into the device
    load_s: float  # seconds spent reading and checking its blocks (disk, shared; else 0)
    bad_files: int = 0  # files found corrupt or truncated at load: removed, recomputed
    write_failures: int = 0  # blocks its filesystem refused (full): not stored
    # prompts whose hits here were computed again: reading a block back was the slower
    # (--kv-tier-reads measured; engine/kv_cache/load_gate.py)
    passed_over: int = 0
    # a block file's read and check lately, seconds (decayed over ~10 reads; what a worker's
    # read gate and the routers' disk credit compare with computing; 0: none read yet); the
    # host tier's: one block's copy back, measured at start (the routers' host credit)
    recent_load_s: float = 0.0
    # blocks not stored: its writer behind the step was past its queue (the disk or the store
    # slower than blocks arrive)
    writes_dropped: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else None
