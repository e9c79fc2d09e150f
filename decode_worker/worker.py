"""DecodeWorker (Ray actor): owns an Engine in decode role, its NIXL agent, the admissions
waiting for blocks, the pulls in flight and the per-router mailboxes.

submit() queues a prefilled request; the engine thread admits it when blocks are free (reusing
its own prefix cache), pulls only the missing blocks with one NIXL READ whose notification
releases the prefill lease, then decodes it in the running batch. A failed or refused pull
falls back to recomputing the prompt locally, so the request still completes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import ray

from decode_worker.mailbox import Mailboxes
from engine.config import EngineConfig
from kvtransfer.base import AgentMetadata, KVTransferError, TransferHandle, TransferState
from kvtransfer.handle import KVHandle
from kvtransfer.handshake import IncompatiblePeerError
from prefill_worker.load import engine_load, served_model
from prefill_worker.worker import make_publisher, set_threads, shut_down
from router.types import GenerateRequest, ServedModel, TokenDelta, WorkerLoad

if TYPE_CHECKING:  # the actor's process imports these; the driver that creates it need not
    from engine.engine import Engine, RequestOutput
    from engine.kv_loading import KVLoadPlan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeWorkerConfig:
    worker_id: str
    engine: EngineConfig
    redis_url: str | None = None
    transfer_timeout_s: float = 10.0
    heartbeat_s: float = 1.0
    num_threads: int | None = None


@dataclass(frozen=True)
class _Admission:
    request: GenerateRequest
    handle: KVHandle
    router_id: str


@dataclass(frozen=True)
class _Pull:
    xfer: TransferHandle
    handle: KVHandle
    started: float
    num_blocks: int


class DecodeWorker:
    def __init__(self, config: DecodeWorkerConfig, actor_name: str = ""):
        from engine.engine import Engine
        from engine.engine_thread import EngineThread
        from kvtransfer.nixl_transfer import NixlTransfer

        set_threads(config.num_threads)
        self.config = config
        self.worker_id = config.worker_id
        self.actor_name = actor_name or config.worker_id
        self.engine = Engine(config.engine)
        self.transfer = NixlTransfer(
            self.engine.model_id,
            agent_name=f"{self.worker_id}-nixl",
            timeout_s=config.transfer_timeout_s,
        )
        self.transfer.register(self.engine.kv_cache)
        self.block_bytes = self.transfer.metadata().block_bytes
        self.publisher = make_publisher(
            config.redis_url,
            config.worker_id,
            self.engine,
            self.actor_name,
            "decode",
            self.transfer.agent_name,
        )
        self.mailboxes = Mailboxes()
        self._peer_meta: dict[str, AgentMetadata] = {}
        self._peers: dict[str, str | None] = {}  # prefill actor -> NIXL peer (None: refused)
        self._admissions: deque[_Admission] = deque()
        self._pulls: dict[str, _Pull] = {}
        self._routes: dict[str, str] = {}  # req_id -> router_id
        self._first_delta: dict[str, dict] = {}
        self._next_heartbeat = 0.0
        self.num_transferred_blocks = 0
        self.num_recomputed = 0
        self.thread = EngineThread(self.engine, self._on_outputs, self._on_tick)

    # ---- actor API -----------------------------------------------------------------------
    async def submit(self, request: GenerateRequest, handle: KVHandle, router_id: str) -> None:
        """Queue a prefilled request; its tokens arrive through next_deltas(router_id)."""
        if handle.actor_name not in self._peer_meta:
            try:
                actor = ray.get_actor(handle.actor_name)
                self._peer_meta[handle.actor_name] = await actor.metadata.remote()
            except Exception as e:  # the prefill worker is gone: recompute locally
                logger.warning("no metadata from %s (%s); will recompute", handle.actor_name, e)
        admission = _Admission(request, handle, router_id)
        await self.thread.call(lambda engine: self._admissions.append(admission))

    async def next_deltas(self, router_id: str, timeout_s: float = 1.0) -> list[TokenDelta]:
        return await self.mailboxes.take(router_id, timeout_s)

    async def abort(self, req_id: str) -> None:
        await self.thread.call(lambda engine: self._abort(engine, req_id))

    async def load(self) -> WorkerLoad:
        return await self.thread.call(engine_load)

    def served_model(self) -> ServedModel:
        return served_model(self.engine)

    async def stats(self) -> dict[str, int]:
        return {
            "num_transferred_blocks": self.num_transferred_blocks,
            "num_recomputed": self.num_recomputed,
        }

    async def check_no_leaks(self) -> dict[str, int]:
        def run(engine: Engine) -> dict[str, int]:
            engine.check_integrity()
            return {
                "free": engine.kv.num_free_blocks,
                "total": engine.kv.num_blocks,
                "requests": len(engine.scheduler.requests) + len(engine.loader.loading),
                "pulls": len(self._pulls),
                "open_handles": self.transfer.num_open_handles,
            }

        return await self.thread.call(run)

    def shutdown(self) -> None:
        shut_down(self.thread, self.publisher, self.transfer)

    # ---- engine thread -------------------------------------------------------------------
    def _abort(self, engine: Engine, req_id: str) -> None:
        for admission in list(self._admissions):
            if admission.request.req_id == req_id:
                self._admissions.remove(admission)
                _release_lease(admission.handle)
        pull = self._pulls.pop(req_id, None)
        if pull is not None:
            self._release_xfer(pull.xfer)
            _release_lease(pull.handle)
        engine.abort(req_id)
        self._routes.pop(req_id, None)
        self._first_delta.pop(req_id, None)

    def _on_tick(self) -> bool:
        self._admit()
        self._poll_pulls()
        now = time.time()
        if self.publisher is not None and now >= self._next_heartbeat:
            self.engine.kv.pool.drain_events()
            self.publisher.heartbeat(engine_load(self.engine))
            self._next_heartbeat = now + self.config.heartbeat_s
        return bool(self._pulls or self._admissions)

    def _admit(self) -> None:
        while self._admissions:
            admission = self._admissions[0]
            request, handle = admission.request, admission.handle
            try:
                plan = self.engine.add_prefilled_request(
                    request.req_id,
                    request.prompt_token_ids,
                    handle.first_token_id,
                    replace(request.sampling, stop=()),
                    request.cache_salt,
                )
            except ValueError as e:
                self._admissions.popleft()
                _release_lease(handle)
                self._send(
                    admission.router_id,
                    TokenDelta(
                        request.req_id, (), finished=True, finish_reason="error", error=str(e)
                    ),
                )
                continue
            if plan is None:
                return  # FIFO: wait for blocks rather than overtake
            self._admissions.popleft()
            self._routes[request.req_id] = admission.router_id
            self._start_pull(handle, plan)

    def _start_pull(self, handle: KVHandle, plan: KVLoadPlan) -> None:
        req_id = handle.req_id
        if not plan.local_block_ids:
            self.engine.commit_kv(req_id)
            _release_lease(handle)
            return
        peer = self._peer(handle.actor_name)
        expired = handle.lease_expires_at - time.time() < self.config.transfer_timeout_s / 10
        if peer is None or expired:
            self._recompute(handle, "lease expired" if expired else "peer unavailable")
            return
        first = plan.first_block
        remote = handle.block_ids[first : first + len(plan.local_block_ids)]
        try:
            xfer = self.transfer.read(peer, remote, plan.local_block_ids, req_id.encode())
        except (ValueError, KVTransferError) as e:
            self._recompute(handle, f"read refused: {e}")
            return
        self._pulls[req_id] = _Pull(xfer, handle, time.monotonic(), len(remote))

    def _poll_pulls(self) -> None:
        for req_id, pull in list(self._pulls.items()):
            state = self.transfer.poll(pull.xfer)
            if state is TransferState.PENDING:
                continue
            del self._pulls[req_id]
            reason = self.transfer.failure_reason(pull.xfer)
            self._release_xfer(pull.xfer)
            if state is TransferState.DONE:
                self.engine.commit_kv(req_id)
                self.num_transferred_blocks += pull.num_blocks
                self._first_delta[req_id] = {
                    "num_transferred_blocks": pull.num_blocks,
                    "transfer_bytes": pull.num_blocks * self.block_bytes,
                    "transfer_s": time.monotonic() - pull.started,
                }
            else:
                self._recompute(pull.handle, f"read failed: {reason}")

    def _recompute(self, handle: KVHandle, why: str) -> None:
        logger.warning("request %s: %s; recomputing its prompt locally", handle.req_id, why)
        self.engine.fail_kv(handle.req_id)
        self.num_recomputed += 1
        self._first_delta[handle.req_id] = {"recomputed": True}
        _release_lease(handle)

    def _peer(self, actor_name: str) -> str | None:
        if actor_name not in self._peers:
            meta = self._peer_meta.get(actor_name)
            try:
                self._peers[actor_name] = self.transfer.add_peer(meta) if meta else None
            except IncompatiblePeerError as e:
                logger.error("refusing KV from %s: %s", actor_name, e)
                self._peers[actor_name] = None
            except KVTransferError as e:
                logger.error("cannot connect to %s: %s", actor_name, e)
                return None
        return self._peers[actor_name]

    def _release_xfer(self, xfer: TransferHandle) -> None:
        try:
            self.transfer.release(xfer)
        except KVTransferError as e:
            logger.warning("could not release a NIXL transfer: %s", e)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        by_router: dict[str, list[TokenDelta]] = {}
        for out in outputs:
            router_id = self._routes.get(out.req_id)
            if router_id is None:
                continue
            if out.finished:
                del self._routes[out.req_id]
            extra = self._first_delta.pop(out.req_id, {})
            by_router.setdefault(router_id, []).append(
                TokenDelta(
                    out.req_id,
                    tuple(out.new_token_ids),
                    finished=out.finished,
                    finish_reason=out.finish_reason,
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_cached_tokens=out.num_cached_tokens,
                    logprobs=tuple(out.new_logprobs or ()),
                    **extra,
                )
            )
        for router_id, deltas in by_router.items():
            self.mailboxes.push(router_id, deltas)

    def _send(self, router_id: str, delta: TokenDelta) -> None:
        self.mailboxes.push(router_id, [delta])


def _release_lease(handle: KVHandle) -> None:
    """Tell the prefill worker to drop its lease (fire and forget; expiry is the backstop)."""
    try:
        ray.get_actor(handle.actor_name).release.remote(handle.req_id)
    except Exception as e:
        logger.info("could not reach %s to release %s: %s", handle.actor_name, handle.req_id, e)
