"""EngineBackend: a test-support Backend over one real Engine stepping on its own thread; owns
the per-request asyncio queues the step outputs are demultiplexed into (one batch per step).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from common.messages import GenerateRequest, TokenDelta
from engine.engine import Engine
from engine.engine_thread import EngineThread
from engine.finish_reason import FinishReason
from engine.sampling.validation import InvalidField
from engine.step.step_types import RequestOutput
from router.backend import Backend

T = TypeVar("T")


def delta_from_output(out: RequestOutput) -> TokenDelta:
    return TokenDelta(
        req_id=out.req_id,
        token_ids=tuple(out.new_token_ids),
        finished=out.finished,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        logprobs=tuple(out.new_logprobs or ()),
        top_logprobs=tuple(out.new_top_logprobs or ()),
        index=out.index,
    )


class EngineBackend(Backend):
    """Call start() inside the serving event loop; every method then runs on that loop."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.model_id = engine.model_id
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.aborted: list[str] = []  # req ids the engine dropped through abort()
        self.num_started = 0  # requests the engine accepted
        self._queues: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: EngineThread | None = None
        self._changed = threading.Condition()  # notified when a request's stream ends

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = EngineThread(lambda: self.engine)
        self._thread.serve(self._on_outputs)

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop()

    # ---- engine thread -> loop -----------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._queues.get(out.req_id)
            if queue is not None:
                queue.put_nowait(delta_from_output(out))

    async def call(self, command: Callable[[Engine], T]) -> T:
        """Run command(engine) on the engine thread, between steps."""
        assert self._thread is not None, "start() the backend first"
        return await self._thread.call(command)

    # ---- Backend -------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        req_id = request.req_id
        queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
        self._queues[req_id] = queue
        finished = False
        try:
            prompt, sampling = list(request.prompt_token_ids), request.sampling
            salt = request.cache_salt
            try:
                await self.call(lambda e: e.add_request(req_id, prompt, sampling, salt))
            except InvalidField:  # refused (a grammar that does not compile): the workers
                raise  # raise it to the router too, which answers 400 naming the field
            except ValueError as e:
                finished = True
                yield TokenDelta(req_id, (), True, FinishReason.ERROR, error=str(e))
                return
            self._notify(started=1)
            num_open = sampling.n  # choices not finished yet (each ends with its own delta)
            while not finished:
                delta = await queue.get()
                num_open -= delta.finished
                finished = num_open == 0 or delta.finish_reason == FinishReason.ERROR
                yield delta
        finally:  # no await here: the abort is queued even if the task is cancelled again
            if not finished:
                self._submit_abort(req_id)
            del self._queues[req_id]
            self._notify()

    def _abort_on_engine(self, engine: Engine, req_id: str) -> None:
        if engine.abort(req_id):
            self.aborted.append(req_id)

    def _submit_abort(self, req_id: str) -> None:
        assert self._thread is not None
        self._thread.submit(lambda e: self._abort_on_engine(e, req_id), lambda *_: None)

    async def abort(self, req_id: str) -> None:
        await self.call(lambda e: self._abort_on_engine(e, req_id))

    async def health(self) -> dict[str, object]:
        alive = self._thread is not None and self._thread._thread.is_alive()
        return {"ok": alive, "model": self.model_id, "running": len(self._queues)}

    # ---- test helpers (any thread) -------------------------------------------------------
    def _notify(self, started: int = 0) -> None:
        with self._changed:
            self.num_started += started
            self._changed.notify_all()

    def wait_until(
        self, predicate: Callable[[EngineBackend], bool], timeout_s: float = 30.0
    ) -> None:
        """Block until predicate(self) holds; checked whenever a request starts or ends."""
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self), timeout_s):
                raise TimeoutError(f"timed out; open requests: {sorted(self._queues)}")

    def wait_until_idle(self, timeout_s: float = 30.0) -> None:
        """Block until no request stream is open (its abort, if any, is queued by then)."""
        self.wait_until(lambda backend: not backend._queues, timeout_s)
