"""DecodeStreams' long-poll (router/decode_streams.py) against a scripted decode actor: a batch
of deltas reaches the streams' readers before the next long-poll is sent, so a request's first
token does not wait for the next poll's submission."""

from __future__ import annotations

import asyncio

from common.messages import TokenDelta
from router.decode_streams import DecodeStreams, Stream


class ScriptedActor:
    """next_deltas.remote(): the scripted batches one per poll, then polls that never answer;
    `log` records each poll sent and each delta a reader took, in order."""

    def __init__(self, batches: list[list[TokenDelta]], log: list[str]):
        self.batches = batches
        self.log = log
        self.next_deltas = self

    def remote(self, router_id: str, timeout_s: float) -> asyncio.Future[list[TokenDelta]]:
        self.log.append("poll")
        future: asyncio.Future[list[TokenDelta]] = asyncio.get_running_loop().create_future()
        if self.batches:
            future.set_result(self.batches.pop(0))
        return future


def test_a_batch_reaches_its_readers_before_the_next_poll_is_sent() -> None:
    async def run() -> list[str]:
        log: list[str] = []
        streams = DecodeStreams("router-0", lambda worker_id: None, lambda worker_id: "ready")
        readers = []
        for req_id in ("a", "b"):
            queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
            streams.open(req_id, Stream(queue, "d0", req_id))

            async def read(queue: asyncio.Queue[TokenDelta] = queue) -> None:
                delta = await queue.get()
                log.append(f"took {delta.req_id}")

            readers.append(asyncio.create_task(read()))
        first = [TokenDelta("a", (1,), False), TokenDelta("b", (2,), False)]
        actor = ScriptedActor([first], log)
        streams.ensure_poller("d0", actor)  # type: ignore[arg-type]
        await asyncio.gather(*readers)
        for _ in range(3):
            await asyncio.sleep(0)
        streams.stop()
        return log

    assert asyncio.run(run()) == ["poll", "took a", "took b", "poll"]
