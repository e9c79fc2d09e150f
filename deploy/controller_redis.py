"""What the controller asks of Redis (holds no state): whether it answers and how many workers
it lists, for status; and removing a dead worker's membership and block entries at once."""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from common import kv_index_schema as schema
from common.cluster_state import RedisStatus
from common.redis_url import redact

logger = logging.getLogger(__name__)


async def redis_status(url: str | None, model_id: str | None) -> RedisStatus:
    """Reachability and the registered worker count (0 before the model is known)."""
    if not url:
        return RedisStatus("")
    client = aioredis.Redis.from_url(url, socket_timeout=1.0, socket_connect_timeout=1.0)
    try:
        await client.ping()
        num = await client.scard(schema.registry_key(model_id)) if model_id else 0
        return RedisStatus(redact(url), True, int(num))
    except Exception as e:
        return RedisStatus(redact(url), False, error=f"{type(e).__name__}: {e}")
    finally:
        await client.aclose()


async def forget_in_index(url: str | None, model_id: str | None, worker_id: str) -> None:
    """A dead worker's membership and block entries leave Redis now, not at their TTL, so
    every router stops seeing it at its next placement; Redis down: the TTL removes it later."""
    if not url or not model_id:
        return
    from router.prefix_index import PrefixIndex

    index = PrefixIndex(url, model_id, reap_dead=False)
    try:
        await index.forget_worker(worker_id, force=True)
    except Exception as e:
        logger.warning("controller: could not remove %s from the index: %s", worker_id, e)
    finally:
        await index.close()
