"""WorkerBase (common/worker_runtime.py): what both worker roles answer alike, on real workers
(no Ray, no Redis) over a tiny random checkpoint: load and served model, the controller's state
moves, stats of the role's shape, the drain's retire, the leak check, refusals once closed, a
decode worker's prefilled requests waiting for KV room counted as waiting, one shutdown, a role
whose own start fails stopping the engine thread, a step that raises ending its requests, and
a prefill call (or a decode worker's submit or local prompt) that comes after its abort taking
nothing.

The workers run in one spawned child process: NIXL's native library aborts a process that has
loaded grpc_tools' (test_proto_stubs.py does), so it is kept out of the test runner's."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import pytest

from common.cluster_state import (
    WARMUP_REQ_PREFIX,
    DecodeStats,
    PrefillStats,
    WorkerState,
    WorkerUnavailable,
)
from common.messages import GenerateRequest, KVHandle, TokenDelta
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine.config import CacheConfig, EngineConfig
from engine.finish_reason import FinishReason
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


def test_decode_counts_prefilled_requests_waiting_for_kv_room(in_child) -> None:
    in_child(decode_prefilled_waiting_for_room)


def test_shutdown_happens_once_and_refuses_later_calls(in_child) -> None:
    in_child(shutdown_twice)


def test_a_role_whose_own_start_fails_leaves_no_engine_thread(in_child) -> None:
    in_child(role_start_fails)


def test_a_step_that_raises_ends_its_requests_with_an_error_not_a_hang(in_child) -> None:
    in_child(step_raises_once)


def test_a_prefill_call_that_comes_after_its_abort_computes_and_leases_nothing(in_child) -> None:
    in_child(abort_before_its_prefill_call)


# ---- the scenarios (in the child) ---------------------------------------------------------------
def test_a_submit_or_local_prompt_that_comes_after_its_abort_decodes_nothing(in_child) -> None:
    in_child(abort_before_its_submit)


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


async def wire(decode: DecodeWorker, prefill: PrefillWorker, released: list | None = None) -> None:
    """Connect the two as Ray would (the handshake check_peer makes; a lease release calls the
    prefill worker); released: each released lease's req_id is added to it."""
    loop = asyncio.get_running_loop()

    def release(handle: KVHandle) -> None:  # engine thread -> the prefill worker's call
        assert handle.epoch is not None
        if released is not None:
            released.append(handle.req_id)
        call = prefill.release(handle.req_id, handle.epoch)
        loop.call_soon_threadsafe(asyncio.ensure_future, call)

    decode.puller.release_lease = release
    meta = prefill.metadata()
    await decode.thread.call(lambda engine: decode.puller.connect(prefill.actor_name, meta))


async def retire_both(decode: DecodeWorker, prefill: PrefillWorker) -> None:
    """The decode worker drains clean, then the prefill worker's leases end (a read's DONE
    notice releases its lease there) and it holds nothing."""
    check = await decode.retire()
    assert check is not None and check.clean, check
    for _ in range(2000):  # polls, not a time bound
        if (await prefill.num_leases()) == 0:
            break
        await asyncio.sleep(0.01)
    assert (await prefill.check_no_leaks()).clean


def decode_prefilled_waiting_for_room(config: EngineConfig) -> None:
    """A prefilled request that finds no room on the decode worker waits in its puller, outside
    the engine: its load (load(), stats(), what it publishes) says waiting 1 beside the one
    running, until the running one ends and it is admitted. No Ray: the two are wired as Ray
    would (the handshake check_peer makes, a lease release calls the prefill worker)."""
    prefill = prefill_worker(config)
    small = replace(config, cache=replace(config.cache, num_blocks=32))
    decode = DecodeWorker(DecodeWorkerConfig("d-test", small, num_threads=1))
    long_run = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    big = tuple(range(480, 0, -1))  # 31 of the 32 blocks; shares no block with PROMPT

    async def deltas_until(req_id: str, done: Callable[[], Awaitable[bool]]) -> list[TokenDelta]:
        """Poll the router's mailbox (at most 50 ms a poll; a count of polls, not a time bound)
        until `done`; req_id's deltas."""
        got: list[TokenDelta] = []
        for _ in range(2000):
            got += [d for d in await decode.next_deltas("router-1", 0.05) if d.req_id == req_id]
            if await done():
                return got
        raise AssertionError(f"{req_id}: never got there")

    async def scenario() -> None:
        await wire(decode, prefill)
        runs = GenerateRequest("runs", PROMPT, long_run)
        waits = GenerateRequest("waits", big, GREEDY)
        handles = [await prefill.prefill(r) for r in (runs, waits)]
        await decode.submit(runs, handles[0], "router-1")

        async def running() -> bool:
            load = await decode.load()
            return (load.running, load.waiting) == (1, 0)

        await deltas_until("runs", running)
        await decode.submit(waits, handles[1], "router-1")
        load = await decode.load()
        assert (load.running, load.waiting) == (1, 1), load  # was (1, 0): counted nowhere
        stats = await decode.stats()
        assert isinstance(stats, DecodeStats)
        assert (stats.load.running, stats.load.waiting) == (1, 1)
        assert stats.num_blocks_reserved == 0  # it holds no block yet
        await decode.abort("runs")

        async def drained() -> bool:
            return (await decode.stats()).num_in_flight == 0

        got = await deltas_until("waits", drained)
        got += [d for d in await decode.next_deltas("router-1", 0.05) if d.req_id == "waits"]
        assert got[-1].finished and got[-1].finish_reason == FinishReason.LENGTH, got
        # the prefill worker's first token, then the rest from here
        assert 1 + sum(len(d.token_ids) for d in got) == GREEDY.max_tokens
        load = await decode.load()
        assert (load.running, load.waiting, load.free_blocks) == (0, 0, 32)
        done = await decode.stats()
        assert isinstance(done, DecodeStats) and done.num_recomputed == 0  # both read over NIXL
        await retire_both(decode, prefill)

    try:
        asyncio.run(scenario())
    finally:
        decode.shutdown()
        prefill.shutdown()


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


class FailingPrefill(PrefillWorker):
    """A prefill role whose own parts fail to build, after WorkerBase built the engine."""

    def _build_role(self) -> None:
        super()._build_role()
        raise RuntimeError("the role's own start failed")


def role_start_fails(config: EngineConfig) -> None:
    import threading

    def engine_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "kvrelay-engine"}

    before = engine_threads()  # earlier scenarios' workers in this child
    with pytest.raises(RuntimeError, match="the role's own start failed"):
        FailingPrefill(PrefillWorkerConfig("p-fail", config, num_threads=1))
    assert engine_threads() <= before  # stopped, not parked for a serve() that never comes


def step_raises_once(config: EngineConfig) -> None:
    """A bug in a step (a new user's probe: top_k 2^63 overflowed one): before, the request was
    never answered and every later step met the same failure; now its prefill call raises, its
    blocks are freed and the next request is served."""
    from prefill_worker.worker import StepFailed

    prefill = prefill_worker(config)
    output = prefill.engine.output
    process = output.process

    def broken(step: object) -> list:  # after the request is scheduled and computed
        output.process = process  # once
        raise RuntimeError("a bug in the step")

    async def scenario() -> None:
        output.process = broken  # type: ignore[method-assign]
        with pytest.raises(StepFailed, match="a bug in the step"):
            await prefill.prefill(GenerateRequest("r-bad", PROMPT, GREEDY))
        assert (await prefill.load()).running == 0
        copies = prefill.engine.copies
        offload = copies.offload_owed

        def broken_after(kv: object, sync: bool = False) -> None:  # the request has finished
            copies.offload_owed = offload  # in the step, its first token's blocks kept
            raise RuntimeError("a bug after the step's outputs")

        copies.offload_owed = broken_after  # type: ignore[method-assign]
        with pytest.raises(StepFailed, match="a bug after the step's outputs"):
            await prefill.prefill(GenerateRequest("r-bad-2", PROMPT, GREEDY))
        assert (await prefill.check_no_leaks()).clean  # its kept blocks went back
        scheduler = prefill.engine.scheduler
        schedule = scheduler.schedule

        def broken_schedule() -> object:  # nothing runs: the waiting request made it raise
            scheduler.schedule = schedule
            raise RuntimeError("a bug in scheduling")

        scheduler.schedule = broken_schedule  # type: ignore[method-assign]
        with pytest.raises(StepFailed, match="a bug in scheduling"):
            await prefill.prefill(GenerateRequest("r-bad-3", PROMPT, GREEDY))
        handle = await prefill.prefill(GenerateRequest("r-good", PROMPT, GREEDY))
        assert handle.epoch is not None and await prefill.release(handle.req_id, handle.epoch)
        assert (await prefill.check_no_leaks()).clean

    try:
        asyncio.run(scenario())
    finally:
        prefill.shutdown()
    decode = DecodeWorker(DecodeWorkerConfig("d-test", config, num_threads=1))
    output = decode.engine.output
    process = output.process

    def broken_decode(step: object) -> list:
        output.process = process
        raise RuntimeError("a bug in the step")

    async def local() -> None:  # a prompt computed on a decode worker: an error delta
        output.process = broken_decode  # type: ignore[method-assign]
        await decode.prefill_here(GenerateRequest("r-bad", PROMPT, GREEDY), "router-1")
        deltas = await decode.next_deltas("router-1", 30.0)
        assert [(d.req_id, d.finished, d.finish_reason) for d in deltas] == [
            ("r-bad", True, FinishReason.ERROR)
        ]
        assert "a bug in the step" in (deltas[0].error or "")
        assert (await decode.load()).running == 0 and (await decode.check_no_leaks()).clean

    try:
        asyncio.run(local())
    finally:
        decode.shutdown()


def abort_before_its_prefill_call(config: EngineConfig) -> None:
    """Ray runs an async actor's calls in any order: a router that ends a stream whose prefill
    call waits on a busy (or stopped) worker sends abort right after it, and the abort may run
    first. Before, it found nothing and the late call computed the prompt and leased its blocks
    to a decode worker that never came (held until the lease expired); now the call computes
    nothing and ends as cancelled. An abort that finds its request (computing, or leased)
    remembers nothing: the same id is served again."""
    import threading

    prefill = prefill_worker(config)

    async def scenario() -> None:
        await prefill.abort("r-early")
        with pytest.raises(asyncio.CancelledError):
            await prefill.prefill(GenerateRequest("r-early", PROMPT, GREEDY))
        stats = await prefill.stats()
        assert (stats.num_requests, stats.num_computed_tokens, stats.num_in_flight) == (0, 0, 0)
        assert await prefill.num_leases() == 0
        assert (await prefill.check_no_leaks()).clean
        handle = await prefill.prefill(GenerateRequest("r-early", PROMPT, GREEDY))  # used up
        assert handle.epoch is not None and await prefill.num_leases() == 1
        await prefill.abort("r-early")  # ends its unread lease
        assert await prefill.num_leases() == 0
        handle = await prefill.prefill(GenerateRequest("r-early", PROMPT, GREEDY))
        assert handle.epoch is not None and await prefill.release(handle.req_id, handle.epoch)
        # aborted while it waits to be computed: held behind a command, its add and the abort
        # run together (the call's own cleanup aborts it once more)
        gate = threading.Event()
        prefill.thread.submit(lambda engine: gate.wait(60), lambda result, error: None)
        call = asyncio.ensure_future(prefill.prefill(GenerateRequest("r-mid", PROMPT, GREEDY)))
        await asyncio.sleep(0)  # its add is queued
        abort = asyncio.ensure_future(prefill.abort("r-mid"))
        await asyncio.sleep(0)
        gate.set()
        await abort
        with pytest.raises(asyncio.CancelledError):
            await call
        handle = await prefill.prefill(GenerateRequest("r-mid", PROMPT, GREEDY))
        assert handle.epoch is not None and await prefill.release(handle.req_id, handle.epoch)
        assert (await prefill.check_no_leaks()).clean

    try:
        asyncio.run(scenario())
    finally:
        prefill.shutdown()


def abort_before_its_submit(config: EngineConfig) -> None:
    """The decode side of the same race: the router's abort runs before its submit (or its
    prefill_here). Before, the late call decoded the request to its end for a stream no one
    reads, holding its blocks; now it takes nothing (a submit's lease is released) and the id
    is served again. An abort of a request it holds remembers nothing."""
    prefill = prefill_worker(config)
    decode = DecodeWorker(DecodeWorkerConfig("d-test", config, num_threads=1))
    released: list[str] = []

    async def scenario() -> None:
        await wire(decode, prefill, released)
        late = GenerateRequest("late", PROMPT, GREEDY)
        await decode.abort("late")
        await decode.submit(late, await prefill.prefill(late), "router-1")
        await decode.abort("here")
        await decode.prefill_here(GenerateRequest("here", PROMPT, GREEDY), "router-1")
        stats = await decode.stats()
        assert stats.num_in_flight == 0 and (stats.load.running, stats.load.waiting) == (0, 0)
        assert released == ["late"]  # the lease it will not read, given back at once
        assert not [d for d in await decode.next_deltas("router-1", 0.05) if d.finished]
        await decode.prefill_here(GenerateRequest("late", PROMPT, GREEDY), "router-1")  # used up
        got = []
        for _ in range(2000):  # polls, not a time bound
            got += await decode.next_deltas("router-1", 0.05)
            if got and got[-1].finished:
                break
        assert got[-1].req_id == "late" and got[-1].finish_reason == FinishReason.LENGTH, got
        await retire_both(decode, prefill)

    try:
        asyncio.run(scenario())
    finally:
        decode.shutdown()
        prefill.shutdown()
