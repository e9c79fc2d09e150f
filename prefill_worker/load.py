"""Reads a worker's load and served model off its engine (no state); used by both roles."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.types import ServedModel, WorkerLoad

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
