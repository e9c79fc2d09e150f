"""WorkerBase (common/worker_runtime.py): what both worker roles answer alike, on real workers
(no Ray, no Redis) over a tiny random checkpoint: load and served model, the controller's state
moves, stats of the role's shape, the drain's retire, the leak check, refusals once closed, and
one shutdown.

The workers run in one spawned child process: NIXL's native library aborts a process that has
loaded grpc_tools' (test_proto_stubs.py does), so it is kept out of the test runner's."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest

from common.cluster_state import (
    WARMUP_REQ_PREFIX,
    DecodeStats,
    PrefillStats,
    WorkerState,
    WorkerUnavailable,
)
from common.messages import GenerateRequest
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine.config import CacheConfig, EngineConfig
from engine.sampling.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from tests.factories import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = tuple(range(1, 40))  # two full blocks of 16 and a part


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), weights=False)
    cache = CacheConfig(block_size=16, num_blocks=64)
    return EngineConfig(model=str(folder), load_format="dummy", cache=cache)


@pytest.fixture(scope="module")
def in_child(engine_config: EngineConfig) -> Iterator[Callable[[Callable], None]]:
    """Run a scenario (a module-level function of the config) in the child; its failure is
    raised here."""
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as child:
        yield lambda scenario: child.submit(scenario, engine_config).result(timeout=300)


def test_an_idle_worker_reports_its_model_load_and_state(in_child) -> None:
    in_child(idle_prefill_worker)


def test_prefill_counts_user_requests_and_retires_once_its_lease_ends(in_child) -> None:
    in_child(prefill_lease_then_retire)


def test_decode_reports_its_own_figures_and_drains_clean(in_child) -> None:
    in_child(decode_local_prefill_then_retire)


def test_shutdown_happens_once_and_refuses_later_calls(in_child) -> None:
    in_child(shutdown_twice)


# ---- the scenarios (in the child) ---------------------------------------------------------------
def prefill_worker(config: EngineConfig) -> PrefillWorker:
    return PrefillWorker(PrefillWorkerConfig("p-test", config, num_threads=1))


def idle_prefill_worker(config: EngineConfig) -> None:
    prefill = prefill_worker(config)

    async def scenario() -> None:
        model = prefill.served_model()
        assert (model.block_size, model.vocab_size) == (16, 512)
        load = await prefill.load()
        assert (load.running, load.waiting, load.queued_tokens) == (0, 0, 0)
        assert load.free_blocks == load.total_blocks == 64
        joining = await prefill.stats()
        assert type(joining) is PrefillStats and joining.state == WorkerState.JOINING
        assert joining.ready_at is None and joining.load == load
        at = await prefill.set_state(WorkerState.READY)
        await prefill.set_state(WorkerState.READY)  # ready_at: the first time only
        ready = await prefill.stats()
        assert ready.state == WorkerState.READY and ready.ready_at == at
        assert not await prefill.resync_index()  # no Redis: nothing to re-publish

    try:
        asyncio.run(scenario())
    finally:
        prefill.shutdown()


def prefill_lease_then_retire(config: EngineConfig) -> None:
    prefill = prefill_worker(config)

    async def scenario() -> None:
        warmup = await prefill.prefill(GenerateRequest(f"{WARMUP_REQ_PREFIX}0", PROMPT, GREEDY))
        assert warmup.epoch is not None
        await prefill.release(warmup.req_id, warmup.epoch)
        handle = await prefill.prefill(GenerateRequest("r1", PROMPT, GREEDY))
        stats = await prefill.stats()
        assert isinstance(stats, PrefillStats)
        assert stats.num_requests == 1 and stats.first_request_at is not None  # not the warm-up
        assert stats.num_prompt_tokens == len(PROMPT) and stats.num_computed_tokens > 0
        assert stats.num_in_flight == 1 and stats.num_blocks_held == len(handle.block_ids)
        assert await prefill.num_leases() == 1
        assert await prefill.retire() is None  # the lease is live: not drained yet
        assert handle.epoch is not None and await prefill.release(handle.req_id, handle.epoch)
        check = await prefill.retire()
        assert check is not None and check.clean, check
        with pytest.raises(WorkerUnavailable):
            await prefill.prefill(GenerateRequest("late", PROMPT, GREEDY))
        assert (await prefill.check_no_leaks()).clean

    try:
        asyncio.run(scenario())
    finally:
        prefill.shutdown()


def decode_local_prefill_then_retire(config: EngineConfig) -> None:
    decode = DecodeWorker(DecodeWorkerConfig("d-test", config, num_threads=1))

    async def scenario() -> None:
        await decode.prefill_here(GenerateRequest("r1", PROMPT, GREEDY), "router-1")
        tokens: list[int] = []
        while True:
            deltas = await decode.next_deltas("router-1", 5.0)
            tokens += [t for d in deltas for t in d.token_ids]
            if any(d.finished for d in deltas):
                break
        assert len(tokens) == GREEDY.max_tokens
        stats = await decode.stats()
        assert isinstance(stats, DecodeStats) and stats.num_local_prefills == 1
        assert stats.num_requests == 1 and stats.num_in_flight == 0
        assert stats.prefix_hit_rate is None and stats.transfer_bytes_per_s is None
        check = await decode.retire()
        assert check is not None and check.clean, check
        with pytest.raises(WorkerUnavailable):
            await decode.prefill_here(GenerateRequest("late", PROMPT, GREEDY), "router-1")

    try:
        asyncio.run(scenario())
    finally:
        decode.shutdown()


def shutdown_twice(config: EngineConfig) -> None:
    prefill = prefill_worker(config)
    prefill.shutdown()
    prefill.shutdown()  # the second call does nothing
    assert prefill.lifecycle.stopped and prefill.lifecycle.closed

    async def late() -> None:
        with pytest.raises(WorkerUnavailable):
            await prefill.prefill(GenerateRequest("late", PROMPT, GREEDY))
        with pytest.raises(RuntimeError):  # its engine thread has stopped
            await prefill.load()

    asyncio.run(late())
