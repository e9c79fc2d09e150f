"""An engine's operations over all its KV tiers at once (device pool, host tier, disk tier, the
cluster-shared store): each tier's figures (TierStats) and an operator's eviction (`kvrelay kv
evict`). Owns no state: the tiers are KVCacheManager's.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.tier_stats import TierStats


def evict(
    kv: KVCacheManager, block_hashes: Sequence[int], salt_root: int | None = None
) -> dict[str, int]:
    """Drop these blocks (and with salt_root, every block computed under that salt, the shared
    store's files of any worker included) from every tier; returns how many each tier dropped.
    A block in use stays with its request, unfindable; a host copy still being copied stays
    until evicted."""
    hashes = list(block_hashes)
    if salt_root is not None:
        hashes += kv.salts.hashes_of(salt_root)
        if kv.disk_tier is not None:
            hashes += kv.disk_tier.hashes_of_salt(salt_root)
    dropped = {"device": kv.pool.drop_cached(hashes)}
    if kv.host_tier is not None:
        dropped["host"] = kv.host_tier.drop(hashes)
    disk = kv.disk_tier
    if disk is not None:
        dropped["disk"] = disk.evict_hashes(hashes)
        if disk.shared is not None:
            shared = disk.shared.evict_hashes(hashes)
            if salt_root is not None:
                shared += disk.shared.evict_salt(salt_root)
            dropped["shared"] = shared
    kv.salts.forget([h for h in hashes if not kv.prefix.held(h)])  # a lent host copy stays
    return dropped


def tier_stats(
    kv: KVCacheManager, block_bytes: int, host_copy_back_s: float = 0.0
) -> tuple[TierStats, ...]:
    """Each tier's size, use, hits and loads (the device pool, then the tiers kv has); a tier's
    lookups are the prompt blocks the faster tiers lacked. host_copy_back_s: one host tier
    block's copy back, as measured at start (its recent_load_s)."""
    pool, looked = kv.pool, kv.num_lookup_blocks
    device_hits = kv.num_device_hit_blocks
    tiers = [
        TierStats("device", pool.num_blocks, pool.num_holding_blocks, looked, device_hits, 0, 0.0)
    ]
    looked -= device_hits
    if kv.host_tier is not None:
        host, hits = kv.host_tier, kv.num_host_hit_blocks
        tiers.append(
            TierStats(
                "host",
                host.num_slots,
                host.num_cached,
                looked,
                hits,
                hits * block_bytes,
                0.0,
                recent_load_s=host_copy_back_s,
            )
        )
        looked -= hits
    disk = kv.disk_tier
    if disk is None:
        return tuple(tiers)
    hits = disk.num_hit_blocks
    tiers.append(
        TierStats(
            "disk",
            disk.num_slots,
            disk.num_cached,
            looked,
            hits,
            hits * block_bytes,
            disk.read_s,
            disk.num_bad_files,
            disk.num_write_failures,
            disk.num_passed_over,
            disk.recent_load_s or 0.0,
            disk.num_write_dropped,
        )
    )
    looked -= hits
    shared = disk.shared
    if shared is not None:
        shared.collect_writes()  # the publishes landed so far, counted
        hits = shared.num_hit_blocks
        tiers.append(
            TierStats(
                "shared",
                shared.num_slots,
                shared.num_files,
                looked,
                hits,
                hits * block_bytes,
                shared.read_s,
                shared.num_bad_files,
                shared.num_write_failures,
                shared.num_passed_over,
                shared.recent_load_s or 0.0,
                shared.num_publish_dropped,
            )
        )
    return tuple(tiers)
