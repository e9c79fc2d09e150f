"""Reads a worker's load off its engine (no state); shared by both worker roles."""

from __future__ import annotations

from engine.engine import Engine
from router.types import WorkerLoad


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
