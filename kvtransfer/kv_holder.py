"""KVHolder: the holder's side of the KV handoff over an engine's kept blocks. It owns the
LeaseLedger of a prefill worker (which finished requests' blocks are leased, their epochs and
expiries) and every way a lease ends, each of which frees the blocks through the engine's neutral
release_blocks; and the count of blocks leased from the host tier. Torch-free.

A request's blocks are kept by its engine when its first token is out (Engine.add_request with
keep_blocks); the worker then grants a lease on them (grant) or, when no reader will come, drops
them at once (drop). A lease ends by the reader's DONE notice or a fenced release (release), the
holder's own abort of a lease nobody reads yet (abort), or expiry on the holder's clock (expire).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from kvtransfer.base import Notification
from kvtransfer.handoff import HandoffError, Notice, NoticeKind
from kvtransfer.leases import Lease, LeaseLedger

logger = logging.getLogger(__name__)


class KVHolder:
    """Engine thread only.

    Invariants (check_integrity): each live lease names exactly the blocks its engine keeps
    for its req_id; a lease's end frees them once (release_blocks), and nothing else frees the
    blocks of a live lease; kept blocks no live lease accounts for are stranded (num_stranded,
    0 between two engine-thread calls).
    """

    def __init__(
        self, release_blocks: Callable[[str], bool], lease_s: float, nonce: int | None = None
    ) -> None:
        """release_blocks: the engine's neutral operation that frees the blocks kept for a
        req_id (Engine.release_blocks); lease_s: how long a lease lives unread."""
        self.leases = LeaseLedger(nonce)
        self.lease_s = lease_s
        self._release_blocks = release_blocks
        self.num_host_leased_blocks = 0  # leased as host-tier copies (the engine's keep_on_host)

    def grant(
        self, req_id: str, block_ids: Sequence[int], num_host_blocks: int, now: float
    ) -> Lease:
        """Lease the blocks the engine keeps for req_id (their first num_host_blocks ids are
        host-tier slots) to the decode worker that will read them."""
        lease = self.leases.grant(req_id, block_ids, self.lease_s, now)
        self.num_host_leased_blocks += num_host_blocks
        return lease

    def drop(self, req_id: str) -> bool:
        """Kept blocks no reader will read (the prefill was aborted meanwhile, or its first
        token ended every choice): free them now, with no lease."""
        return self._release_blocks(req_id)

    def release(self, req_id: str, epoch: int) -> bool:
        """The reader has the blocks, or gave up: end the lease `epoch` names and free them. A
        stale release (the lease ended, or req_id was leased again since) is ignored and
        counted. True when it freed the blocks."""
        if self.leases.release(req_id, epoch) is None:
            logger.info("ignored a stale release of %s (epoch %x)", req_id, epoch)
            return False
        return self._release_blocks(req_id)

    def abort(self, req_id: str) -> None:
        """The holder's own abort: end a lease nobody reads yet; one being read is left to its
        read's notice or its expiry."""
        if self.leases.revoke(req_id) is not None:
            self._release_blocks(req_id)

    def on_notification(self, notif: Notification, now: float) -> None:
        """A reader's BEGIN extends its lease over the read; its DONE releases it. Anything
        else (not a handoff notice, an illegal move) is logged and ignored."""
        try:
            notice = Notice.decode(notif.msg)
            if notice.kind is NoticeKind.BEGIN:
                self.leases.begin_read(notice.req_id, notice.epoch, now)
            else:
                self.release(notice.req_id, notice.epoch)
        except (ValueError, HandoffError) as e:
            logger.warning("ignored a notification from %s: %s", notif.peer, e)

    def expire(self, now: float) -> list[Lease]:
        """End every lease due by `now` (the holder's monotonic clock) and free its blocks."""
        expired = self.leases.expire(now)
        for lease in expired:
            held_s = lease.expires_at - lease.granted_at  # > lease_s: a read was announced
            logger.warning(
                "lease of %s expired after %.1f s; freeing its blocks", lease.req_id, held_s
            )
            self._release_blocks(lease.req_id)
        return expired

    @property
    def num_live(self) -> int:
        return self.leases.num_live

    def num_stranded(self, kept: Mapping[str, Sequence[int]]) -> int:
        """Blocks the engine keeps (req_id -> block ids) that no live lease accounts for."""
        return self.leases.num_stranded(kept)

    def check_integrity(self, kept: Mapping[str, Sequence[int]]) -> None:
        self.leases.check_integrity(kept)
