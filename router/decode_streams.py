"""DecodeStreams: one router's side of its decode workers' delta batches. Owns each request leg's
stream (its queue, its decode worker, whether that worker was lost) and one long-poll task per
decode worker, which demultiplexes each step's batch into the streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ray.exceptions import RayActorError

from common.messages import TokenDelta
from common.worker_actors import DecodeActor
from engine.finish_reason import FinishReason

logger = logging.getLogger(__name__)
MAX_POLL_ERRORS = 3  # consecutive failed long-polls (not an actor death) that count as death
POLL_RETRY_S = 0.5


@dataclass
class Stream:
    """One leg of a request being decoded (the first, or one after a migration): where its
    deltas go, which decode worker sends them, and whether that worker was lost."""

    queue: asyncio.Queue[TokenDelta]
    decode_worker_id: str
    first_req_id: str
    lost: bool = False


class DecodeStreams:
    """Invariants: a delta reaches only the stream of its req_id (one a leg no longer has is
    dropped); at most one long-poll task runs per decode worker; a lost worker's streams each get
    one error delta."""

    def __init__(
        self,
        router_id: str,
        on_death: Callable[[str], None],
        state_of: Callable[[str], str | None],
    ):
        """on_death(worker_id): a poller saw its worker die (the backend's cleanup, which calls
        lost()); state_of(worker_id): its state as the router knows it."""
        self.router_id = router_id
        self._on_death = on_death
        self._state_of = state_of
        self._streams: dict[str, Stream] = {}
        self._pollers: dict[str, asyncio.Task[None]] = {}

    def open(self, req_id: str, stream: Stream) -> None:
        self._streams[req_id] = stream

    def close(self, req_id: str) -> None:
        self._streams.pop(req_id, None)

    def get(self, req_id: str) -> Stream | None:
        return self._streams.get(req_id)

    def of_request(self, first_req_id: str) -> Stream | None:
        """The current leg of a request (the id the router took it under, or a migration's)."""
        stream = self._streams.get(first_req_id)
        if stream is not None:
            return stream
        return next((s for s in self._streams.values() if s.first_req_id == first_req_id), None)

    def abort_all(self) -> int:
        """Put an abort delta in every open stream; returns how many there were."""
        for req_id, stream in self._streams.items():
            stream.queue.put_nowait(TokenDelta(req_id, (), True, FinishReason.ABORT))
        return len(self._streams)

    def ensure_poller(self, worker_id: str, actor: DecodeActor) -> None:
        task = self._pollers.get(worker_id)
        if task is None or task.done():
            self._pollers[worker_id] = asyncio.create_task(self._poll(worker_id, actor))

    def lost(self, worker_id: str) -> None:
        """The worker died: its poller stops and only the streams it served end, each with an
        error naming it."""
        poller = self._pollers.pop(worker_id, None)
        if poller is not None and poller is not asyncio.current_task():
            poller.cancel()
        for req_id, stream in self._streams.items():
            if stream.decode_worker_id == worker_id:
                stream.lost = True
                error = f"decode worker {worker_id} died while serving this request"
                stream.queue.put_nowait(
                    TokenDelta(req_id, (), True, FinishReason.ERROR, error=error)
                )

    def stop(self) -> None:
        for task in self._pollers.values():
            task.cancel()
        self._pollers.clear()

    async def _poll(self, worker_id: str, actor: DecodeActor) -> None:
        """One long-poll at a time per decode worker: a batch of deltas per engine step.

        The actor's death ends the worker's streams at once; another error is retried a few
        times (a transient one must not blacklist a live worker) before it counts as death."""
        num_errors = 0
        while True:
            try:
                deltas = await actor.next_deltas.remote(self.router_id, 1.0)
            except RayActorError as e:
                if self._state_of(worker_id) == "draining":
                    logger.info("decode worker %s drained and left the cluster", worker_id)
                else:
                    logger.error("decode worker %s died: %s", worker_id, e)
                self._on_death(worker_id)
                return
            except Exception as e:
                num_errors += 1
                logger.warning(
                    "decode worker %s: long-poll failed (%s), try %d", worker_id, e, num_errors
                )
                if num_errors >= MAX_POLL_ERRORS:
                    self._on_death(worker_id)
                    return
                await asyncio.sleep(POLL_RETRY_S)
                continue
            num_errors = 0
            for delta in deltas:
                stream = self._streams.get(delta.req_id)
                if stream is not None:
                    stream.queue.put_nowait(delta)
            if deltas:  # their streams go out to the clients before the next poll is sent
                await asyncio.sleep(0)
