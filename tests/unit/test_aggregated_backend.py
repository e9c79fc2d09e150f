"""ClusterBackend with no prefill worker to take a prompt (fake actors, no Ray cluster): the
prompt is computed on a decode worker (`prefill_here`); a prefill worker that stops taking work
as it is placed on (drained: the pool scaled 0) hands the request to a decode worker, and a
decode worker that stops taking work hands it to another; every token arrives once; a prompt
computed there counts in the router's view of that worker's queue until its first token."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from common.cluster_state import WorkerUnavailable
from common.messages import GenerateRequest, TokenDelta, WorkerInfo
from engine.sampling.sampling_params import SamplingParams
from router.cluster_backend import ClusterBackend
from router.worker_set import WorkerSet

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


class Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]):
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Task:
        return asyncio.ensure_future(self.fn(*args))


class DrainedPrefill:
    """A prefill worker that has turned draining: it refuses every request."""

    def __init__(self) -> None:
        self.num_refused = 0
        self.prefill = Method(self._prefill)
        self.abort = Method(self._noop)

    async def _prefill(self, request: GenerateRequest) -> None:
        self.num_refused += 1
        raise WorkerUnavailable("p0 is draining")

    async def _noop(self, *args: Any) -> None:
        return None


class AggregatedDecode:
    """Computes a prompt itself (prefill_here) and answers with two tokens, one a poll; with
    refuse=True it has stopped taking work."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.computed: list[str] = []
        self.pending: list[TokenDelta] = []
        self.prefill_here = Method(self._prefill_here)
        self.next_deltas = Method(self._next_deltas)
        self.abort = Method(self._abort)

    async def _prefill_here(self, request: GenerateRequest, router_id: str) -> None:
        if self.refuse:
            raise WorkerUnavailable("draining")
        self.computed.append(request.req_id)
        self.pending += [
            TokenDelta(request.req_id, (7,), False, num_prompt_tokens=4, num_cached_tokens=0),
            TokenDelta(request.req_id, (8,), True, "length"),
        ]

    async def _next_deltas(self, router_id: str, timeout_s: float) -> list[TokenDelta]:
        await asyncio.sleep(0.01)
        return [self.pending.pop(0)] if self.pending else []

    async def _abort(self, req_id: str) -> None:
        return None


def serve(workers: WorkerSet) -> tuple[list[TokenDelta], ClusterBackend]:
    async def run() -> tuple[list[TokenDelta], ClusterBackend]:
        backend = ClusterBackend("m", 64, 1000, 16, workers, router_id="router-test")
        request = GenerateRequest("r0", (1, 2, 3, 4), PARAMS)
        deltas = [d async for d in backend.generate(request)]
        await backend.close()
        return deltas, backend

    return asyncio.run(asyncio.wait_for(run(), 10))


def test_no_prefill_worker_computes_the_prompt_on_a_decode_worker() -> None:
    workers, decode = WorkerSet(), AggregatedDecode()
    workers.add("d0", "decode", decode, "d0")  # type: ignore[arg-type]
    deltas, backend = serve(workers)
    assert [t for d in deltas for t in d.token_ids] == [7, 8]
    assert deltas[-1].finish_reason == "length" and decode.computed == ["r0"]
    assert backend.num_local_prefills == 1 and backend.workers.num_placed("d0") == 0


def test_a_prefill_worker_draining_as_it_is_placed_on_leaves_the_prompt_to_decode() -> None:
    workers, prefill, decode = WorkerSet(), DrainedPrefill(), AggregatedDecode()
    workers.add("p0", "prefill", prefill, "p0")  # type: ignore[arg-type]
    workers.add("d0", "decode", decode, "d0")  # type: ignore[arg-type]
    deltas, backend = serve(workers)
    assert prefill.num_refused == 1, "routed to the prefill pool first"
    assert [t for d in deltas for t in d.token_ids] == [7, 8] and decode.computed == ["r0"]
    assert backend.workers.num_placed("p0") == backend.workers.num_placed("d0") == 0


def test_a_decode_worker_that_stopped_taking_work_leaves_the_prompt_to_another() -> None:
    workers, refusing, decode = WorkerSet(), AggregatedDecode(refuse=True), AggregatedDecode()
    workers.add("d0", "decode", refusing, "d0")  # type: ignore[arg-type]
    workers.add("d1", "decode", decode, "d1")  # type: ignore[arg-type]
    deltas, _ = serve(workers)
    assert [t for d in deltas for t in d.token_ids] == [7, 8]
    assert refusing.computed == [] and decode.computed == ["r0"]


class GatedDecode(AggregatedDecode):
    """AggregatedDecode whose tokens come only once `open` is set (a prompt still computing)."""

    def __init__(self) -> None:
        super().__init__()
        self.open = False

    async def _next_deltas(self, router_id: str, timeout_s: float) -> list[TokenDelta]:
        await asyncio.sleep(0.01)
        return [self.pending.pop(0)] if self.open and self.pending else []


def test_a_local_prompt_counts_in_its_workers_queue_until_its_first_token() -> None:
    """The router's own view of a decode worker computing prompts (WorkerSet.with_placed):
    each prompt's tokens count from its placement to its first token, a request cancelled
    before that gives them back, and a decoding one stays placed."""

    async def until(check: Callable[[], bool]) -> None:
        for _ in range(500):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def run() -> None:
        workers, decode = WorkerSet(), GatedDecode()
        workers.add("d0", "decode", decode, "d0")  # type: ignore[arg-type]
        backend = ClusterBackend("m", 64, 1000, 16, workers, router_id="router-test")

        def queued() -> int:
            (seen,) = workers.with_placed([WorkerInfo("d0", "decode", "d0")])
            return seen.load.queued_tokens

        a = backend.generate(GenerateRequest("a", tuple(range(40)), PARAMS))
        first = asyncio.ensure_future(a.__anext__())
        await until(lambda: decode.computed == ["a"])
        assert queued() == 40 and workers.num_placed("d0") == 1

        async def drain(request: GenerateRequest) -> None:
            async for _ in backend.generate(request):
                pass

        b = asyncio.ensure_future(drain(GenerateRequest("b", tuple(range(24)), PARAMS)))
        await until(lambda: decode.computed == ["a", "b"])
        assert queued() == 64 and workers.num_placed("d0") == 2
        b.cancel()  # before its first token: its prompt leaves the count
        await asyncio.gather(b, return_exceptions=True)
        assert queued() == 40 and workers.num_placed("d0") == 1
        decode.open = True
        assert (await first).token_ids == (7,)  # a's first token: its prompt is computed
        assert queued() == 0 and workers.num_placed("d0") == 1  # it decodes on there
        assert [d.token_ids async for d in a] == [(8,)]
        assert workers.num_placed("d0") == 0
        await backend.close()

    asyncio.run(asyncio.wait_for(run(), 20))


class SlowAbortDecode(AggregatedDecode):
    """Sends one token, then nothing; an abort takes until `released` is set (a worker's
    answer, ~0.05-0.2 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.aborts: list[str] = []
        self.released = asyncio.Event()

    async def _prefill_here(self, request: GenerateRequest, router_id: str) -> None:
        self.computed.append(request.req_id)
        self.pending.append(TokenDelta(request.req_id, (7,), False, num_prompt_tokens=4))

    async def _abort(self, req_id: str) -> None:
        self.aborts.append(req_id)
        await self.released.wait()


def test_a_cancelled_stream_unwinds_at_once_and_its_abort_goes_on_behind() -> None:
    """A client gone (its handler task cancelled while it awaits the next token): the stream
    ends at once and the decode worker's abort goes on behind it. It was awaited first, so the
    client's request id stayed in flight that long (a gRPC resend refused ~50-100 ms)."""

    async def run() -> None:
        workers, decode = WorkerSet(), SlowAbortDecode()
        workers.add("d0", "decode", decode, "d0")  # type: ignore[arg-type]
        backend = ClusterBackend("m", 64, 1000, 16, workers, router_id="router-test")
        params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
        got: list[TokenDelta] = []

        async def consume() -> None:
            async for delta in backend.generate(GenerateRequest("r0", (1, 2, 3, 4), params)):
                got.append(delta)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.wait([task])  # on the old code: waits for the abort, held by the test
        assert task.cancelled()
        assert decode.aborts == ["r0"] and not decode.released.is_set()
        decode.released.set()
        await backend.close()

    asyncio.run(asyncio.wait_for(run(), 10))
