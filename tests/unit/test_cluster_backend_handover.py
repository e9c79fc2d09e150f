"""ClusterBackend's handoff when the decode worker dies while the request is being submitted to
it (fake actors, no Ray cluster): whichever the router notices first, the death of the
worker's long-poll or the failed submit, the request goes to another decode worker and
completes there with every token, and nothing stays behind on either decode worker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from ray.exceptions import RayActorError

from common.messages import GenerateRequest, KVHandle, TokenDelta
from engine.sampling.sampling_params import SamplingParams
from router.cluster_backend import ClusterBackend
from router.worker_set import WorkerSet

PARAMS = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
ROUTER = "router-test"


class Method:
    def __init__(self, fn: Callable[..., Awaitable[Any]]):
        self.fn = fn

    def remote(self, *args: Any) -> asyncio.Task:
        return asyncio.ensure_future(self.fn(*args))


class FakePrefill:
    def __init__(self) -> None:
        self.prefill = Method(self._prefill)
        self.release = Method(self._noop)
        self.abort = Method(self._noop)

    async def _prefill(self, request: GenerateRequest) -> KVHandle:
        return KVHandle(request.req_id, "p0", "p0", "p0-nixl", (1,), 4, 100, 1, 1, 30.0)

    async def _noop(self, req_id: str) -> None:
        return None


class DyingDecode:
    """Takes a submit and never answers; die() fails the submit, and first its long-poll when
    the poll sees the death (else the poll just never returns)."""

    def __init__(self, poll_sees_death: bool) -> None:
        self.poll_sees_death = poll_sees_death
        self.submitted = asyncio.Event()
        self._dead = asyncio.Event()
        self.submit = Method(self._submit)
        self.next_deltas = Method(self._next_deltas)
        self.abort = Method(self._dead_call)

    async def _submit(self, request: GenerateRequest, handle: KVHandle, router_id: str) -> None:
        self.submitted.set()
        await self._dead.wait()
        await asyncio.sleep(0.05)  # its poller hears of the death first
        raise RayActorError()

    async def _next_deltas(self, router_id: str, timeout_s: float) -> list[TokenDelta]:
        await self._dead.wait()
        if not self.poll_sees_death:
            await asyncio.Event().wait()
        raise RayActorError()

    async def _dead_call(self, *args: Any) -> None:
        raise RayActorError()

    def die(self) -> None:
        self._dead.set()


class HealthyDecode:
    """Answers a submitted request with its next tokens, one delta per poll."""

    def __init__(self) -> None:
        self.pending: list[TokenDelta] = []
        self.running: set[str] = set()
        self.submit = Method(self._submit)
        self.next_deltas = Method(self._next_deltas)
        self.abort = Method(self._abort)

    async def _submit(self, request: GenerateRequest, handle: KVHandle, router_id: str) -> None:
        self.running.add(request.req_id)
        tokens = [101, 102]
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            self.pending.append(
                TokenDelta(request.req_id, (token,), last, "length" if last else None)
            )

    async def _next_deltas(self, router_id: str, timeout_s: float) -> list[TokenDelta]:
        await asyncio.sleep(0.01)
        if not self.pending:
            return []
        delta = self.pending.pop(0)
        if delta.finished:
            self.running.discard(delta.req_id)
        return [delta]

    async def _abort(self, req_id: str) -> None:
        self.running.discard(req_id)


@pytest.mark.parametrize("poller_first", [True, False])
def test_a_decode_worker_dying_during_submit_hands_the_request_on(poller_first: bool) -> None:
    async def run() -> tuple[list[TokenDelta], HealthyDecode]:
        workers = WorkerSet()
        dying, healthy = DyingDecode(poll_sees_death=poller_first), HealthyDecode()
        workers.add("p0", "prefill", FakePrefill(), "p0")
        workers.add("d0", "decode", dying, "d0")  # placed first (the smaller worker id)
        workers.add("d1", "decode", healthy, "d1")
        backend = ClusterBackend("m", 64, 1000, 16, workers, router_id=ROUTER)
        request = GenerateRequest("r0", (1, 2, 3, 4), PARAMS)

        async def collect() -> list[TokenDelta]:
            return [d async for d in backend.generate(request)]

        task = asyncio.create_task(collect())
        await asyncio.wait_for(dying.submitted.wait(), 5)
        dying.die()
        deltas = await asyncio.wait_for(task, 5)
        await backend.close()
        return deltas, healthy

    deltas, healthy = asyncio.run(run())
    assert [t for d in deltas for t in d.token_ids] == [100, 101, 102]
    assert deltas[-1].finish_reason == "length" and deltas[-1].error is None
    assert not healthy.running
