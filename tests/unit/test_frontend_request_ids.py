"""Frontend alone (a scripted backend): a client's request id is its own from the moment the
router takes the request, so a twin sent while the first waits in the router's queue is refused
at once, and the first runs to its end untouched (both sent on, the loser's abort ended the
other's stream: a gRPC client hung). Inside the cluster every request has an id of its own (the
client's with a random suffix): two tenants, or one client behind two routers, may choose the
same id, and a worker refuses an id it already runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from common.messages import GenerateRequest, TokenDelta
from router.errors import InvalidRequest
from router.frontend import Frontend
from tests.unit.test_tracing import (  # noqa: F401
    OUTPUT,
    HeldBackend,
    ScriptedBackend,
    spec,
    tokenizer,
)


def test_a_twin_of_a_queued_request_is_refused_and_the_first_runs(tokenizer) -> None:  # noqa: F811
    async def go() -> None:
        backend = HeldBackend()
        frontend = Frontend(backend, tokenizer, max_running_requests=1)
        tokens: dict[str, int] = {}

        async def drain(name: str, request_id: str) -> None:
            prepared = await frontend.prepare(replace(spec(), req_id=request_id))
            tokens[name] = 0
            async for chunk in frontend.generate(prepared):
                tokens[name] += len(chunk.token_ids)

        holder = asyncio.create_task(drain("holder", "holder"))
        await asyncio.sleep(0.01)
        first = asyncio.create_task(drain("first", "twin"))  # waits for the running slot
        await asyncio.sleep(0.01)
        assert frontend.queue.num_queued == 1
        with pytest.raises(InvalidRequest, match="'twin' is already in flight"):
            await asyncio.wait_for(drain("second", "twin"), 10)  # queued behind: TimeoutError
        backend.release.set()
        await asyncio.gather(holder, first)
        assert tokens == {"holder": len(OUTPUT), "first": len(OUTPUT), "second": 0}
        await drain("again", "twin")  # free again once the first ended
        assert tokens["again"] == len(OUTPUT)
        twins = [r.req_id for r in backend.requests if r.req_id.startswith("twin-")]
        assert len(twins) == len(set(twins)) == 2  # one id each inside the cluster

    asyncio.run(go())


def test_two_tenants_may_use_one_request_id_at_once(tokenizer) -> None:  # noqa: F811
    """Another tenant's ids are not this one's: the same id in flight for two tenants runs
    twice, under two cluster ids, and each stream is the whole output."""

    async def go() -> None:
        backend = HeldBackend()
        frontend = Frontend(backend, tokenizer)
        got: dict[str, tuple[str, int]] = {}

        async def drain(tenant: str) -> None:
            prepared = await frontend.prepare(replace(spec(), req_id="job-1", tenant=tenant))
            count = 0
            async for chunk in frontend.generate(prepared):
                count += len(chunk.token_ids)
            got[tenant] = (prepared.client_id, count)

        tasks = [asyncio.create_task(drain(t)) for t in ("team-a", "team-b")]
        await asyncio.sleep(0.01)  # both in flight: neither refused
        backend.release.set()
        await asyncio.gather(*tasks)
        assert got == {"team-a": ("job-1", len(OUTPUT)), "team-b": ("job-1", len(OUTPUT))}
        ids = [r.req_id for r in backend.requests]
        assert len(ids) == len(set(ids)) == 2 and all(i.startswith("job-1-") for i in ids)

    asyncio.run(go())


def test_a_request_id_the_cluster_cannot_carry_is_refused_naming_the_field(
    tokenizer,  # noqa: F811
) -> None:
    async def go() -> None:
        frontend = Frontend(ScriptedBackend(), tokenizer)
        with pytest.raises(InvalidRequest, match="request_id: at most 256 characters, got 257"):
            await frontend.prepare(replace(spec(), req_id="x" * 257))
        for bad in ("a\nb", "a\x00b", "a\u200bb", "a\u202eb", "a\u2028b"):
            with pytest.raises(InvalidRequest, match="request_id: no control, format or line"):
                await frontend.prepare(replace(spec(), req_id=bad))
        for spaced in ("a b", "a\u00a0b", "a\u3000b", " r\u00e9q-\u65e5\U0001f680 "):
            assert (await frontend.prepare(replace(spec(), req_id=spaced))).client_id == spaced
        prepared = await frontend.prepare(replace(spec(), req_id="ä" * 256))
        assert prepared.client_id == "ä" * 256 and prepared.request.req_id != prepared.client_id
        own = await frontend.prepare(spec())  # no client id: the router's, the same inside
        assert own.client_id == own.request.req_id and own.client_id.startswith("req-")

    asyncio.run(go())


class SlowAbort(ScriptedBackend):
    """Streams slowly; an abort takes until `aborted` is set (a worker's answer, ~0.2 s)."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = asyncio.Event()
        self.aborts: list[str] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        async for delta in super().generate(request):
            yield delta
            await asyncio.sleep(0.01)

    async def abort(self, req_id: str) -> None:
        self.aborts.append(req_id)
        await self.aborted.wait()


def test_a_cancelled_requests_id_is_free_again_before_its_abort_ends(tokenizer) -> None:  # noqa: F811
    """A client that cancels a stream and resends under the same id is not refused as a twin
    while the cancelled one's abort is still on its way (it was, for ~0.2 s); the abort ends the
    cancelled one's cluster id only, and the resent one streams its whole output."""

    async def go() -> None:
        backend = SlowAbort()
        frontend = Frontend(backend, tokenizer)

        async def drain(limit: int | None = None) -> int:
            prepared = await frontend.prepare(replace(spec(), req_id="job-7"))
            count = 0
            stream = frontend.generate(prepared)
            async for chunk in stream:
                count += len(chunk.token_ids)
                if limit is not None and count >= limit:
                    break
            await stream.aclose()
            return count

        first = asyncio.create_task(drain(limit=1))
        while not backend.aborts:  # the first left after its first token: its abort is on
            await asyncio.sleep(0.005)
        assert not first.done()
        assert await asyncio.wait_for(drain(), 10) == len(OUTPUT)  # not refused as a twin
        # A client gone while the next token is awaited (its task cancelled: a disconnect).
        gone = asyncio.create_task(drain())
        while len(backend.requests) < 3:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.015)
        gone.cancel()
        while len(backend.aborts) < 2:
            await asyncio.sleep(0.005)
        assert await asyncio.wait_for(drain(), 10) == len(OUTPUT)
        backend.aborted.set()
        assert await first == 1
        with pytest.raises(asyncio.CancelledError):
            await gone
        ids = [r.req_id for r in backend.requests]
        assert backend.aborts == [ids[0], ids[2]] and len(set(ids)) == 4

    asyncio.run(go())
