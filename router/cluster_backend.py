"""ClusterBackend: places each request on a prefill worker (KV-aware, from the Redis index) and a
decode worker, and demultiplexes decode workers' per-step delta batches into request streams.

Owns the per-request queues, one long-poll task per decode worker, and index-health state.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from engine.kv_cache.hashing import hash_blocks
from router.metrics import RouterMetrics
from router.policy import PrefillPolicy, choose_decode, make_prefill_policy, route_by_load
from router.prefix_index import IndexUnavailable, PrefixIndex
from router.types import Backend, GenerateRequest, TokenDelta, WorkerInfo
from router.worker_set import WorkerSet

logger = logging.getLogger(__name__)


class ClusterBackend(Backend):
    def __init__(
        self,
        model_id: str,
        max_model_len: int,
        vocab_size: int,
        block_size: int,
        workers: WorkerSet,
        index: PrefixIndex | None = None,
        policy: PrefillPolicy | None = None,
        router_id: str | None = None,
    ):
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.workers = workers
        self.index = index
        self.policy = policy or make_prefill_policy("kv_aware")
        self.router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
        self._streams: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._stream_owner: dict[str, str] = {}  # req_id -> decode worker id
        self._pollers: dict[str, asyncio.Task[None]] = {}
        self._index_down_logged = False
        self.num_index_unavailable = 0
        self.last_placements: dict[str, str] = {}  # req_id -> prefill worker (for tests/logs)
        self.metrics: RouterMetrics | None = None  # set by the server that owns the registry

    # ---- placement -----------------------------------------------------------------------
    async def _candidates(
        self, role: str, hashes: list[int]
    ) -> tuple[list[WorkerInfo], dict[str, int] | None]:
        """Live workers of a role and their prefix overlap; overlap None: index unavailable."""
        if self.index is not None:
            try:
                view = await self.index.view(role, hashes)
                self._record_index(True, view.workers)
                if self._index_down_logged:
                    logger.warning("Redis index is back: routing by KV overlap again")
                    self._index_down_logged = False
                workers = self.workers.filter_known(view.workers)
                if workers:
                    return workers, view.overlap
            except IndexUnavailable as e:
                self._record_index(False, [])
                self.num_index_unavailable += 1
                if not self._index_down_logged:
                    logger.warning("Redis index unavailable (%s): routing by load alone", e)
                    self._index_down_logged = True
        return self.workers.known(role), None

    def _record_index(self, available: bool, workers: list[WorkerInfo]) -> None:
        if self.metrics is None:
            return
        self.metrics.set_index_available(available)
        for worker in workers:
            self.metrics.set_worker_load(worker)

    async def _place_prefill(self, request: GenerateRequest) -> WorkerInfo:
        hashes = hash_blocks(
            request.prompt_token_ids, self.block_size, self.model_id, request.cache_salt
        )
        workers, overlap = await self._candidates("prefill", hashes)
        if overlap is None:
            return route_by_load(workers).worker
        return self.policy.choose(workers, overlap, self.block_size).worker

    async def _place_decode(self, request: GenerateRequest) -> WorkerInfo:
        workers, _ = await self._candidates("decode", [])
        needed = -(
            -(len(request.prompt_token_ids) + request.sampling.max_tokens) // self.block_size
        )
        return choose_decode(workers, needed)

    # ---- streaming -----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        req_id = request.req_id
        prefill = await self._place_prefill(request)
        self.last_placements[req_id] = prefill.worker_id
        prefill_actor = self.workers.actor(prefill)
        stage = "prefill"
        decode_actor: Any = None
        num_prompt = len(request.prompt_token_ids)
        self.workers.inflight_tokens[prefill.worker_id] += num_prompt
        self.workers.inflight_requests[prefill.worker_id] += 1
        try:
            try:
                handle = await prefill_actor.prefill.remote(request)
            finally:
                self.workers.inflight_tokens[prefill.worker_id] -= num_prompt
                self.workers.inflight_requests[prefill.worker_id] -= 1
            first = TokenDelta(
                req_id,
                (handle.first_token_id,),
                finished=handle.finish_reason is not None,
                finish_reason=handle.finish_reason,
                num_prompt_tokens=handle.num_tokens,
                num_cached_tokens=handle.num_cached_tokens,
                logprobs=() if handle.first_logprob is None else (handle.first_logprob,),
            )
            if first.finished:
                stage = "done"
                yield first
                return
            stage = "handed"
            decode = await self._place_decode(request)
            decode_actor = self.workers.actor(decode)
            queue: asyncio.Queue[TokenDelta] = asyncio.Queue()
            self._streams[req_id] = queue
            self._stream_owner[req_id] = decode.worker_id
            self._ensure_poller(decode, decode_actor)
            await decode_actor.submit.remote(request, handle, self.router_id)
            stage = "decode"
            yield first
            while True:
                # Cached prompt tokens are the prefill worker's hits (what was not recomputed);
                # the decode worker's own reuse only shortens the transfer.
                delta = replace(await queue.get(), num_cached_tokens=handle.num_cached_tokens)
                if delta.transfer_bytes and self.metrics is not None:
                    self.metrics.observe_transfer(delta.transfer_s, delta.transfer_bytes)
                if delta.finished and delta.finish_reason != "abort":
                    stage = "done"  # an abort delta is local: the decode side still needs telling
                yield delta
                if delta.finished:
                    return
        finally:
            self._streams.pop(req_id, None)
            self._stream_owner.pop(req_id, None)
            self.last_placements.pop(req_id, None)
            if stage == "prefill":
                await _quietly(prefill_actor.abort.remote(req_id))
            elif stage == "handed":
                await _quietly(prefill_actor.release.remote(req_id))
            elif stage == "decode" and decode_actor is not None:
                await _quietly(decode_actor.abort.remote(req_id))

    def _ensure_poller(self, decode: WorkerInfo, actor: Any) -> None:
        task = self._pollers.get(decode.worker_id)
        if task is None or task.done():
            self._pollers[decode.worker_id] = asyncio.create_task(
                self._poll(decode.worker_id, actor)
            )

    async def _poll(self, worker_id: str, actor: Any) -> None:
        """One long-poll at a time per decode worker: a batch of deltas per engine step."""
        while True:
            try:
                deltas = await actor.next_deltas.remote(self.router_id, 1.0)
            except Exception as e:
                logger.error("decode worker %s failed: %s", worker_id, e)
                for queue in list(self._streams.values()):
                    queue.put_nowait(
                        TokenDelta("", (), True, "error", error=f"decode worker {worker_id} failed")
                    )
                self.workers.remove(worker_id)
                return
            for delta in deltas:
                queue = self._streams.get(delta.req_id)
                if queue is not None:
                    queue.put_nowait(delta)

    async def abort(self, req_id: str) -> None:
        queue = self._streams.get(req_id)
        if queue is not None:
            queue.put_nowait(TokenDelta(req_id, (), True, "abort"))

    async def health(self) -> dict[str, object]:
        prefill = self.workers.known("prefill")
        decode = self.workers.known("decode")
        index_ok = self.index is None or self.index.available
        return {
            "ok": bool(prefill and decode),
            "prefill_workers": len(prefill),
            "decode_workers": len(decode),
            "redis": "absent" if self.index is None else ("ok" if index_ok else "unavailable"),
        }

    async def close(self) -> None:
        for task in self._pollers.values():
            task.cancel()
        self._pollers.clear()


async def _quietly(ref: Any) -> None:
    try:
        await ref
    except Exception as e:
        logger.info("cleanup call failed: %s", e)
