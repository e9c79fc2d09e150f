"""KVPuller (decode side of the KV handoff): owns the admissions waiting for blocks, the NIXL
reads in flight, the peers it reads from and each request's transfer stats until they are sent.

Life cycle of one request: submit() -> admitted when the pool has room (FIFO; the engine reuses
its own prefix cache, so only missing blocks are read) -> one NIXL READ -> poll() sees it done:
commit, or failed: recompute the prompt locally. The lease on the prefill worker's blocks is
released on every path (the READ's notification also releases it; release is idempotent).
Runs on the engine thread only; Ray stays outside (the worker passes peers and a release hook).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from common.messages import GenerateRequest, KVHandle, TransferStats
from kvtransfer.base import (
    AgentMetadata,
    KVTransfer,
    KVTransferError,
    TransferHandle,
    TransferState,
)
from kvtransfer.handshake import IncompatiblePeerError

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.kv_loading import KVLoadPlan

logger = logging.getLogger(__name__)


class Refused(NamedTuple):
    """A request the engine could not take (its lease is already released)."""

    req_id: str
    error: str


@dataclass(frozen=True)
class _Pull:
    xfer: TransferHandle
    handle: KVHandle
    started: float  # time.monotonic()
    num_blocks: int


class KVPuller:
    """Invariants: a request is in at most one of admissions / pulls; once it has left both, its
    lease has been released and its blocks are the engine's (committed, recomputing or freed)."""

    def __init__(
        self,
        engine: Engine,
        transfer: KVTransfer,
        release_lease: Callable[[KVHandle], None],
        timeout_s: float,
    ):
        self.engine = engine
        self.transfer = transfer
        self.release_lease = release_lease
        self.timeout_s = timeout_s
        self.block_bytes = transfer.metadata().block_bytes
        self._peer_meta: dict[str, AgentMetadata] = {}
        self._peers: dict[str, str | None] = {}  # prefill actor -> NIXL peer (None: refused)
        self._admissions: deque[tuple[GenerateRequest, KVHandle]] = deque()
        self._pulls: dict[str, _Pull] = {}
        self._stats: dict[str, TransferStats] = {}
        self.num_transferred_blocks = 0
        self.transfer_seconds = 0.0  # summed duration of completed pulls
        self.num_recomputed = 0

    # ---- interface -----------------------------------------------------------------------
    def knows_peer(self, actor_name: str) -> bool:
        return actor_name in self._peer_meta

    def add_peer_metadata(self, actor_name: str, meta: AgentMetadata) -> None:
        self._peer_meta[actor_name] = meta

    def connect(self, actor_name: str, meta: AgentMetadata) -> None:
        """Handshake with a prefill worker ahead of its first pull; raises
        IncompatiblePeerError (or KVTransferError) instead of recomputing later."""
        self._peers[actor_name] = self.transfer.add_peer(meta)
        self._peer_meta[actor_name] = meta

    def submit(self, request: GenerateRequest, handle: KVHandle) -> None:
        self._admissions.append((request, handle))

    def step(self) -> list[Refused]:
        """Admit what fits, poll the reads in flight; returns the requests refused."""
        refused = self._admit()
        self._poll()
        return refused

    def abort(self, req_id: str) -> None:
        for request, handle in list(self._admissions):
            if request.req_id == req_id:
                self._admissions.remove((request, handle))
                self.release_lease(handle)
        pull = self._pulls.pop(req_id, None)
        if pull is not None:
            self._release_xfer(pull.xfer)
            self.release_lease(pull.handle)
        self._stats.pop(req_id, None)

    def take_stats(self, req_id: str) -> TransferStats | None:
        """How the request's KV arrived, once (for its first delta)."""
        return self._stats.pop(req_id, None)

    @property
    def busy(self) -> bool:
        return bool(self._pulls or self._admissions)

    @property
    def num_pulls(self) -> int:
        return len(self._pulls)

    # ---- internals -----------------------------------------------------------------------
    def _admit(self) -> list[Refused]:
        refused = []
        while self._admissions:
            request, handle = self._admissions[0]
            try:
                plan = self.engine.add_prefilled_request(
                    request.req_id,
                    request.prompt_token_ids,
                    handle.first_token_id,
                    request.sampling,  # stop strings stay in the router: none reach a worker
                    request.cache_salt,
                )
            except ValueError as e:
                self._admissions.popleft()
                self.release_lease(handle)
                refused.append(Refused(request.req_id, str(e)))
                continue
            if plan is None:
                break  # FIFO: wait for blocks rather than overtake
            self._admissions.popleft()
            self._start(handle, plan)
        return refused

    def _start(self, handle: KVHandle, plan: KVLoadPlan) -> None:
        req_id = handle.req_id
        if not plan.local_block_ids:
            self.engine.commit_kv(req_id)
            self._stats[req_id] = TransferStats()
            self.release_lease(handle)
            return
        peer = self._peer(handle.actor_name)
        expired = handle.lease_expires_at - time.time() < self.timeout_s / 10
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

    def _poll(self) -> None:
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
                seconds = time.monotonic() - pull.started
                self.transfer_seconds += seconds
                self._stats[req_id] = TransferStats(
                    num_blocks=pull.num_blocks,
                    num_bytes=pull.num_blocks * self.block_bytes,
                    seconds=seconds,
                )
            else:
                self._recompute(pull.handle, f"read failed: {reason}")

    def _recompute(self, handle: KVHandle, why: str) -> None:
        logger.warning("request %s: %s; recomputing its prompt locally", handle.req_id, why)
        self.engine.fail_kv(handle.req_id)
        self.num_recomputed += 1
        self._stats[handle.req_id] = TransferStats(recomputed=True)
        self.release_lease(handle)

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
