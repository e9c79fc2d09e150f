"""bench/lib/serve_client.SpreadClient: one client per server, a conversation's turns all to one
server, single-turn requests round-robin by index, and close() closes every client."""

from __future__ import annotations

import asyncio

from bench.lib.serve_client import BenchRequest, Client, RequestResult, Sampling, SpreadClient


class RecordingClient(Client):
    """Answers at once, remembering what it was sent (a stand-in for one server's client)."""

    def __init__(self) -> None:
        super().__init__(Sampling(0.0, True, None), 1.0)
        self.sent: list[int] = []
        self.closed = False

    async def send(self, request: BenchRequest) -> RequestResult:
        self.sent.append(request.index)
        return RequestResult(request.index, request.group)

    async def _stream(self, request: BenchRequest, result: RequestResult) -> None:  # unused
        raise AssertionError("send is overridden")

    async def close(self) -> None:
        self.closed = True


def test_turns_stay_with_their_conversation_and_single_requests_alternate() -> None:
    clients = [RecordingClient(), RecordingClient()]
    spread = SpreadClient(clients)
    turns = [BenchRequest(i, (1,), 4, conversation=i // 3, turn=i % 3) for i in range(9)]
    singles = [BenchRequest(100 + i, (1,), 4) for i in range(4)]

    async def run() -> None:
        for request in [*turns, *singles]:
            await spread.send(request)
        await spread.close()

    asyncio.run(run())
    assert clients[0].sent == [0, 1, 2, 6, 7, 8, 100, 102]  # conversations 0 and 2
    assert clients[1].sent == [3, 4, 5, 101, 103]
    assert all(c.closed for c in clients)
