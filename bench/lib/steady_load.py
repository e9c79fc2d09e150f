"""A steady load for cluster benches: requests at a fixed rate over a fixed prompt set, each
sent by a LoadClient (the in-process ClusterBackend, or HTTP to a router), recorded as a
RequestRecord. Owns one run's tasks and records; drain() bounds how long a request may take.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

COMPLETED = frozenset({"length", "stop"})


@dataclass
class RequestRecord:
    """What one request did; times are time.time(). `end` None: it has not ended (yet)."""

    req_id: str
    index: int  # into the load's prompts
    start: float
    first: float | None = None  # first output
    end: float | None = None
    token_ids: list[int] = field(default_factory=list)  # the backend client's output
    text: str = ""  # the HTTP client's output
    finish_reason: str | None = None
    error: str | None = None
    hung: bool = False  # still running when drain()'s bound ran out (then cancelled)

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason in COMPLETED

    @property
    def failed(self) -> bool:
        return self.end is not None and not self.hung and not self.completed

    def output(self) -> None:
        if self.first is None:
            self.first = time.time()


class LoadClient(abc.ABC):
    """Sends one request of the load and fills its record (never raises)."""

    @abc.abstractmethod
    async def send(self, record: RequestRecord) -> None: ...


class BackendClient(LoadClient):
    """Through a router's ClusterBackend in this process: the output is token ids."""

    def __init__(self, backend: Any, prompts: Sequence[Sequence[int]], params: Any):
        self.backend = backend
        self.prompts = [tuple(p) for p in prompts]
        self.params = params

    async def send(self, record: RequestRecord) -> None:
        from common.messages import GenerateRequest

        request = GenerateRequest(record.req_id, self.prompts[record.index], self.params)
        try:
            async for delta in self.backend.generate(request):
                record.output()
                record.token_ids.extend(delta.token_ids)
                if delta.finished:
                    record.finish_reason = delta.finish_reason
                    record.error = delta.error or (
                        "finished with an error" if delta.finish_reason == "error" else None
                    )
        except Exception as e:
            record.error = f"{type(e).__name__}: {e}"


class HttpClient(LoadClient):
    """Streaming /v1/completions with the prompt as token ids: the output is text."""

    def __init__(
        self, base_url: str, model: str, prompts: Sequence[Sequence[int]], max_tokens: int
    ):
        self.url = f"{base_url}/v1/completions"
        self.model = model
        self.prompts = [list(p) for p in prompts]
        self.max_tokens = max_tokens
        self.session: Any = None  # aiohttp.ClientSession, made on the running loop

    async def send(self, record: RequestRecord) -> None:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession()
        body = {
            "model": self.model,
            "prompt": self.prompts[record.index],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            async with self.session.post(self.url, json=body) as response:
                if response.status != 200:
                    record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return
                async for line in response.content:
                    self._on_line(record, line)
            if record.finish_reason is None and record.error is None:
                record.error = "the stream ended without a finish reason"
        except aiohttp.ClientError as e:  # the router went away mid-response
            record.error = f"connection to the router lost ({type(e).__name__})"

    def _on_line(self, record: RequestRecord, line: bytes) -> None:
        if not line.startswith(b"data: {"):
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            record.error = chunk["error"].get("message", "error")
            return
        choice = chunk["choices"][0]
        record.output()
        record.text += choice.get("text") or ""
        record.finish_reason = choice.get("finish_reason") or record.finish_reason

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


class SteadyLoad:
    """`rate` requests per second from run() until stop(); prompts in turn."""

    def __init__(self, client: LoadClient, num_prompts: int, rate: float, prefix: str):
        self.client = client
        self.num_prompts = num_prompts
        self.rate = rate
        self.prefix = prefix
        self.records: list[RequestRecord] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    async def run(self) -> None:
        i = 0
        while not self._stop.is_set():
            record = RequestRecord(f"{self.prefix}{i}", i % self.num_prompts, time.time())
            self.records.append(record)
            self._tasks.append(asyncio.create_task(self._one(record)))
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 1 / self.rate)

    async def _one(self, record: RequestRecord) -> None:
        try:
            await self.client.send(record)
        finally:
            record.end = time.time()

    def stop(self) -> None:
        self._stop.set()

    def in_flight(self) -> list[RequestRecord]:
        return [r for r in self.records if r.end is None]

    async def drain(self, bound_s: float) -> list[RequestRecord]:
        """Wait for every request to end, each until `bound_s` after its start; the ones still
        running then are hung: cancelled and returned."""
        for record, task in zip(self.records, self._tasks, strict=True):
            left = record.start + bound_s - time.time()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), max(0.0, left))
        hung = [r for r, t in zip(self.records, self._tasks, strict=True) if not t.done()]
        for record, task in zip(self.records, self._tasks, strict=True):
            if not task.done():
                record.hung = True
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        return hung
