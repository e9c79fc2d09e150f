"""What both worker roles share (no state of its own): reading a worker's load and served model
off its engine, thread set-up, the Redis publisher it runs, and shutting a worker down."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.kv_publisher import KVPublisher
from common.messages import ServedModel, WorkerLoad

if TYPE_CHECKING:
    from engine.engine import Engine


def engine_load(engine: Engine) -> WorkerLoad:
    sched = engine.scheduler
    queued = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting)
    queued += sum(r.num_tokens - r.num_computed_tokens for r in sched.running)
    return WorkerLoad(
        running=len(sched.running),
        waiting=len(sched.waiting) + len(engine.loader.loading),
        free_blocks=engine.kv.num_free_blocks,
        total_blocks=engine.kv.num_blocks,
        queued_tokens=queued,
    )


def served_model(engine: Engine) -> ServedModel:
    return ServedModel(
        model_id=engine.model_id,
        checkpoint_dir=str(engine.checkpoint_dir),
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        block_size=engine.kv.block_size,
    )


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)


def make_publisher(
    redis_url: str | None,
    worker_id: str,
    engine: Engine,
    actor_name: str,
    role: str,
    agent_name: str,
) -> KVPublisher | None:
    """The worker's Redis publisher, or None when the cluster runs without Redis."""
    if not redis_url:
        return None
    return KVPublisher(
        redis_url,
        engine.model_id,
        worker_id,
        role,
        cached_hashes=engine.kv.pool.cached_hashes,
        actor_name=actor_name,
        nixl_agent=agent_name,
    )


def shut_down(thread: Any, publisher: KVPublisher | None, transfer: Any) -> None:
    """Stop a worker's engine thread, withdraw it from the index, close its NIXL agent."""
    thread.stop()
    if publisher is not None:
        publisher.withdraw()
        publisher.close()
    transfer.close()
