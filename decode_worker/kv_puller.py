"""KVPuller (decode side of the KV handoff): owns the PullLedger of its requests' pulls (queued
for blocks, reserved, reading) and a record of each peer it reads from; each step says which
requests it refused and how the others' KV arrived.

Life cycle of one request (kvtransfer/pulls.py has the states): submit() queues it -> admitted
when the pool has room, or when preempting running requests of lower priority makes it
(priority, then FIFO; the engine reuses its own prefix cache, so only missing blocks are read)
-> a BEGIN notice to the prefill worker, then one NIXL READ whose DONE notice releases the
lease -> poll() sees it done: commit, or failed: recompute the prompt locally. Every path that
does not end in a completed READ releases the lease itself, naming its epoch. A READ may only be
posted before the pull's deadline (its own clock: receipt + most of lease_s) and must be seen
done within lease_s of being posted. Runs on the engine thread only; Ray stays outside (the
worker passes peers and a release hook).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
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
from kvtransfer.handoff import Notice, NoticeKind
from kvtransfer.handshake import IncompatiblePeerError
from kvtransfer.pulls import Pull, PullLedger, PullState

if TYPE_CHECKING:
    from engine.engine import Engine
    from engine.step.kv_loading import KVLoadPlan
    from engine.step.request import PrefilledChoices

logger = logging.getLogger(__name__)


class Refused(NamedTuple):
    """A request the engine could not take (its lease is already released)."""

    req_id: str
    error: str


class Arrival(NamedTuple):
    """How a request's prompt KV arrived (read, local, or recomputed), for its first delta."""

    req_id: str
    transfer: TransferStats


class PullerStep(NamedTuple):
    """What one KVPuller.step ended: requests refused, and requests whose KV is in place."""

    refused: list[Refused]
    arrived: list[Arrival]


@dataclass
class Peer:
    """A prefill worker this puller reads from: its NIXL metadata (None until it is sent), its
    NIXL peer name once a handshake succeeded, refused once one failed for good (an
    incompatible layout, or no metadata when its first pull needed it)."""

    meta: AgentMetadata | None = None
    nixl_name: str | None = None
    refused: bool = False


class Handoff(NamedTuple):
    """What a pull carries: the request and the prefill worker's handle."""

    request: GenerateRequest
    handle: KVHandle


class KVPuller:
    """Invariants: a submitted request has one live pull in the ledger until it is committed,
    recomputed, refused or aborted; then its lease has been released (by the READ's DONE notice
    or by release_lease) and its blocks are the engine's. The engine's loading requests are
    exactly the reserved and reading pulls (num_stranded_blocks() == 0)."""

    def __init__(
        self,
        engine: Engine,
        transfer: KVTransfer,
        release_lease: Callable[[KVHandle], None],
    ):
        self.engine = engine
        self.transfer = transfer
        self.release_lease = release_lease
        self.block_bytes = transfer.metadata().block_bytes
        self.ledger: PullLedger[Handoff] = PullLedger()
        self._peers: dict[str, Peer] = {}  # prefill actor name -> its record
        self._arrived: list[Arrival] = []  # during a step: the arrivals it returns
        self.num_transferred_blocks = 0
        self.num_host_read_blocks = 0  # of them, from a prefill worker's host tier
        self.transfer_seconds = 0.0  # summed duration of completed pulls
        self.num_recomputed = 0
        self.num_refused_handshakes = 0

    # ---- interface -----------------------------------------------------------------------
    def knows_peer(self, actor_name: str) -> bool:
        peer = self._peers.get(actor_name)
        return peer is not None and peer.meta is not None

    def add_peer_metadata(self, actor_name: str, meta: AgentMetadata) -> None:
        self._peers.setdefault(actor_name, Peer()).meta = meta

    def connect(self, actor_name: str, meta: AgentMetadata) -> None:
        """Handshake with a prefill worker ahead of its first pull; raises
        IncompatiblePeerError (or KVTransferError) instead of recomputing later."""
        try:
            nixl_name = self.transfer.add_peer(meta)
        except IncompatiblePeerError:
            self.num_refused_handshakes += 1
            raise
        peer = self._peers.setdefault(actor_name, Peer())
        peer.meta, peer.nixl_name, peer.refused = meta, nixl_name, False

    def submit(self, request: GenerateRequest, handle: KVHandle, received_at: float) -> None:
        """received_at: time.monotonic() when the handle reached this worker (the pull's
        deadline is reckoned from it)."""
        if handle.epoch is None:
            raise ValueError(f"the handle of {request.req_id!r} holds no lease")
        self.ledger.queue(
            request.req_id, handle.epoch, handle.lease_s, received_at, Handoff(request, handle)
        )

    def step(self) -> PullerStep:
        """Admit what fits, poll the reads in flight; returns the requests refused and those
        whose KV is now in place."""
        refused = self._admit()
        self._poll()
        arrived, self._arrived = self._arrived, []
        return PullerStep(refused, arrived)

    def abort(self, req_id: str) -> None:
        pull = self.ledger.abort(req_id)
        if pull is not None:
            if pull.xfer is not None:
                self._release_xfer(pull.xfer)
            self.release_lease(pull.payload.handle)

    @property
    def busy(self) -> bool:
        return self.ledger.num_live > 0

    @property
    def num_queued(self) -> int:
        """Requests waiting for local blocks (no block held here yet, not in the engine)."""
        return len(self.ledger.in_state(PullState.QUEUED))

    @property
    def num_pulls(self) -> int:
        return len(self.ledger.in_state(PullState.READING))

    def num_stranded_blocks(self) -> int:
        """Blocks the engine holds for loading requests that no pull accounts for (0)."""
        return self.ledger.num_stranded(self.engine.loading_block_ids())

    def check_integrity(self) -> None:
        self.ledger.check_integrity(self.engine.loading_block_ids())

    # ---- internals -----------------------------------------------------------------------
    def _admit(self) -> list[Refused]:
        refused = []
        queued = self.ledger.in_state(PullState.QUEUED)
        for pull in sorted(queued, key=lambda pull: -pull.payload.request.priority):  # stable
            request, handle = pull.payload
            try:
                plan = self.engine.add_prefilled_request(
                    request.req_id,
                    request.prompt_token_ids,
                    handle.first_token_id,
                    request.sampling,  # stop strings stay in the router: none reach a worker
                    request.cache_salt,
                    request.num_resumed_tokens,
                    _choices(handle),
                    request.kv_retention,
                    request.priority,
                )
            except ValueError as e:
                self.ledger.fail(request.req_id)
                self.release_lease(handle)
                refused.append(Refused(request.req_id, str(e)))
                continue
            if plan is None:
                break  # priority, then FIFO: wait for blocks rather than overtake
            self._start(self.ledger.reserve(request.req_id, plan.local_block_ids), plan)
        return refused

    def _start(self, pull: Pull[Handoff], plan: KVLoadPlan) -> None:
        req_id, handle = pull.req_id, pull.payload.handle
        if not plan.local_block_ids:
            self.engine.commit_kv(req_id)
            self.ledger.commit(req_id)
            self._arrived.append(Arrival(req_id, TransferStats()))
            self.release_lease(handle)
            return
        peer = self._peer(handle.actor_name)
        now = time.monotonic()
        if peer is None or not pull.read_window_open(now):
            late = f"lease too close to its end ({pull.deadline - now:.2f} s left)"
            self._recompute(pull, "peer unavailable" if peer is None else late)
            return
        first = plan.first_block
        remote = handle.block_ids[first : first + len(plan.local_block_ids)]
        num_host = min(max(0, handle.num_host_blocks - first), len(remote))  # lead the handle
        try:
            self.transfer.notify(peer, Notice(NoticeKind.BEGIN, req_id, pull.epoch).encode())
            if self.engine.followers and not self._read_on_ranks(
                pull, handle, remote, plan.local_block_ids, num_host
            ):
                return
            done = Notice(NoticeKind.DONE, req_id, pull.epoch).encode()
            xfer = self.transfer.read(peer, remote, plan.local_block_ids, done, num_host)
            self.num_host_read_blocks += num_host
        except (ValueError, KVTransferError) as e:
            self._recompute(pull, f"read refused: {e}")
            return
        self.ledger.start_reading(req_id, xfer, now)

    def _poll(self) -> None:
        for pull in self.ledger.in_state(PullState.READING):
            assert pull.xfer is not None and pull.read_by is not None
            state = self.transfer.poll(pull.xfer)
            late = time.monotonic() > pull.read_by  # after polling: DONE came no later
            if state is TransferState.PENDING and not late:
                continue
            reason = self.transfer.failure_reason(pull.xfer)
            self._release_xfer(pull.xfer)
            if state is TransferState.DONE and not late:
                self._commit_read(pull)
            else:
                self._recompute(pull, f"read failed: {reason or 'not done within the lease'}")

    def _commit_read(self, pull: Pull[Handoff]) -> None:
        assert pull.read_started_at is not None
        self.engine.commit_kv(pull.req_id)
        self.ledger.commit(pull.req_id)
        num_blocks = len(pull.block_ids)
        self.num_transferred_blocks += num_blocks
        seconds = time.monotonic() - pull.read_started_at
        self.transfer_seconds += seconds
        transfer = TransferStats(
            num_blocks=num_blocks, num_bytes=num_blocks * self.block_bytes, seconds=seconds
        )
        self._arrived.append(Arrival(pull.req_id, transfer))

    def _recompute(self, pull: Pull[Handoff], why: str) -> None:
        logger.warning("request %s: %s; recomputing its prompt locally", pull.req_id, why)
        self.engine.fail_kv(pull.req_id)
        self.ledger.fail(pull.req_id)
        self.num_recomputed += 1
        self._arrived.append(Arrival(pull.req_id, TransferStats(recomputed=True)))
        self.release_lease(pull.payload.handle)

    def _read_on_ranks(
        self,
        pull: Pull[Handoff],
        handle: KVHandle,
        remote: Sequence[int],
        local: Sequence[int],
        num_host: int,
    ) -> bool:
        """A TP worker: its ranks 1.. read their own heads first (each over its own NIXL agent;
        done before rank 0's read, whose DONE notice ends the holder's lease), the first
        num_host from the holder ranks' host tiers. False: the prompt is recomputed."""
        from engine.parallel.step_plan import ReadPlan

        meta = self._peers[handle.actor_name].meta
        if not self.engine.read_on_ranks(ReadPlan(meta, list(remote), list(local), num_host)):
            self._recompute(pull, "a tensor-parallel rank's read failed")
            return False
        return True

    def _peer(self, actor_name: str) -> str | None:
        """The NIXL peer to read from; None when the worker is refused or unreachable now."""
        peer = self._peers.setdefault(actor_name, Peer())
        if peer.nixl_name is not None or peer.refused:
            return peer.nixl_name
        if peer.meta is None:
            peer.refused = True
            return None
        try:
            peer.nixl_name = self.transfer.add_peer(peer.meta)
        except IncompatiblePeerError as e:
            logger.error("refusing KV from %s: %s", actor_name, e)
            self.num_refused_handshakes += 1
            peer.refused = True
        except KVTransferError as e:
            logger.error("cannot connect to %s: %s", actor_name, e)
        return peer.nixl_name

    def _release_xfer(self, xfer: TransferHandle) -> None:
        try:
            self.transfer.release(xfer)
        except KVTransferError as e:
            logger.warning("could not release a NIXL transfer: %s", e)


def _choices(handle: KVHandle) -> PrefilledChoices | None:
    """n > 1: the choices the prefill worker's first tokens leave to decode (None: n = 1)."""
    if not handle.other_choices:
        return None
    from engine.step.request import PrefilledChoices

    first_token_ids = {
        index: choice.token_id
        for index, choice in enumerate(handle.other_choices, 1)
        if choice.finish_reason is None
    }
    return PrefilledChoices(first_token_ids, handle.finish_reason)
