"""Frontend alone (a scripted backend): a client's request id is its own from the moment the
router takes the request, so a twin sent while the first waits in the router's queue is refused
at once, and the first runs to its end untouched (both sent on, the loser's abort ended the
other's stream: a gRPC client hung)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from common.messages import GenerateRequest, TokenDelta
from router.errors import InvalidRequest
from router.frontend import Frontend
from tests.unit.test_tracing import OUTPUT, ScriptedBackend, spec, tokenizer  # noqa: F401


class Held(ScriptedBackend):
    """Holds every request until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        await self.release.wait()
        async for delta in super().generate(request):
            yield delta


def test_a_twin_of_a_queued_request_is_refused_and_the_first_runs(tokenizer) -> None:  # noqa: F811
    async def go() -> None:
        backend = Held()
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
        assert [r.req_id for r in backend.requests].count("twin") == 2

    asyncio.run(go())
