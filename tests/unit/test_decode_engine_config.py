"""A decode worker's step budget (deploy/worker_launch.decode_engine_config): its batch plus the
prompt chunk it computes beside it, so a local prefill delays decodes by one chunk per step."""

from __future__ import annotations

from deploy.worker_launch import WorkerTemplate, decode_engine_config
from engine.config import EngineConfig, SchedulerConfig


def test_the_chunk_is_added_to_the_batch() -> None:
    engine = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096))
    chunked = decode_engine_config(WorkerTemplate(engine, None, decode_prefill_chunk_tokens=256))
    assert chunked.scheduler.max_num_batched_tokens == 32 + 256
    assert chunked.scheduler.max_num_seqs == 32 and chunked.model == engine.model
    assert decode_engine_config(WorkerTemplate(engine, None)) is engine  # None: unchanged
