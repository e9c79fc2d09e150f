"""Reads the cluster's Redis prefix index after a shared-prefix run: which prefill workers hold
each group's prefix. One holder per group means the group stayed on one worker (its prefix was
prefilled once); two means it was prefilled on both. Read-only; owns one short-lived Redis
connection. usage.cached_tokens cannot tell this apart: it is the larger of the prefill
worker's and the decode worker's prefix hits.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from bench.lib.serve_client import check_loopback

_REDIS_IN_LOG = re.compile(r"local redis-server at (redis://\S+)")


def redis_url_from_log(text: str) -> str | None:
    """The URL `kvrelay serve` prints for the redis-server it started."""
    match = _REDIS_IN_LOG.search(text)
    return match.group(1) if match else None


def prefill_holders(
    redis_url: str, model_id: str, prefixes: Sequence[Sequence[int]], block_size: int
) -> dict[str, Any]:
    """Per group, the prefill workers whose index entry holds the prefix's last full block
    (holding it implies holding the whole chain before it)."""
    import redis

    from common.kv_index_schema import block_key, worker_key
    from engine.kv_cache.hashing import hash_blocks

    check_loopback(urlsplit(redis_url).hostname or "")
    client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    try:
        holders: list[list[str]] = []
        for prefix in prefixes:
            hashes = hash_blocks(list(prefix), block_size, model_id)
            holders.append(
                sorted(client.smembers(block_key(model_id, hashes[-1]))) if hashes else []
            )
        worker_ids = sorted({w for group in holders for w in group})
        roles = {w: client.hget(worker_key(model_id, w), "role") for w in worker_ids}
    finally:
        client.close()
    prefill = [[w for w in group if roles.get(w) == "prefill"] for group in holders]
    copies = [len(group) for group in prefill]
    return {
        "prefill_holders_per_group": prefill,
        "prefill_copies_per_group": copies,
        "mean_prefill_copies": sum(copies) / len(copies) if copies else 0.0,
        "prefix_tokens_indexed": (len(prefixes[0]) // block_size) * block_size if prefixes else 0,
    }
