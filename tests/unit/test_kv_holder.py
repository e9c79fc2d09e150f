"""KVHolder (kvtransfer/kv_holder.py), the holder's side of the KV handoff, over a real
KVCacheManager's kept blocks (its release_blocks is the manager's release_kept): every way a lease
ends frees the kept blocks exactly once, a stale release or notice frees nothing, a read announced
by BEGIN outlives the holder's abort, and the pool is leak-free after each path."""

from __future__ import annotations

import logging

import pytest

from engine.kv_cache.host_tier import HostTier
from engine.kv_cache.manager import KVCacheManager
from engine.step.request import Request
from kvtransfer.base import Notification
from kvtransfer.handoff import Notice, NoticeKind
from kvtransfer.kv_holder import KVHolder
from kvtransfer.leases import LeaseState

BLOCK_SIZE = 4
LEASE_S = 10.0


def make_holder(kv: KVCacheManager) -> KVHolder:
    return KVHolder(kv.release_kept, LEASE_S, nonce=1)


def kept(kv: KVCacheManager, req_id: str, num_tokens: int = 10) -> tuple[int, ...]:
    """A finished request's blocks, kept (as a keep_blocks request's are at its first token)."""
    req = Request(req_id, list(range(1, num_tokens + 1)))
    kv.allocate(req, num_tokens)
    req.num_computed_tokens = num_tokens
    kv.cache_full_blocks(req)
    return kv.keep(req).block_ids


def notice(kind: NoticeKind, req_id: str, epoch: int) -> Notification:
    return Notification("reader", Notice(kind, req_id, epoch).encode())


def test_the_readers_done_notice_ends_the_lease_and_frees_the_blocks() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, "m")
    holder = make_holder(kv)
    lease = holder.grant("r", kept(kv, "r"), 0, now=0.0)
    holder.check_integrity(kv.kept.block_ids())
    assert holder.num_live == 1 and holder.num_stranded(kv.kept.block_ids()) == 0
    holder.on_notification(notice(NoticeKind.BEGIN, "r", lease.epoch), now=1.0)
    assert holder.leases.num_blocks(LeaseState.BEING_READ) == 3
    holder.on_notification(notice(NoticeKind.DONE, "r", lease.epoch), now=2.0)
    assert holder.num_live == 0
    holder.check_integrity(kv.kept.block_ids())
    kv.assert_all_free()


def test_a_stale_release_frees_nothing_and_the_fenced_one_frees_once() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, "m")
    holder = make_holder(kv)
    first = holder.grant("r", kept(kv, "r"), 0, now=0.0)
    assert holder.release("r", first.epoch)
    second = holder.grant("r", kept(kv, "r"), 0, now=1.0)  # the same req_id prefilled again
    assert not holder.release("r", first.epoch)  # the first grant's late release
    holder.on_notification(notice(NoticeKind.DONE, "r", first.epoch), now=2.0)
    assert holder.leases.num_stale == 2 and "r" in kv.kept
    holder.check_integrity(kv.kept.block_ids())
    assert holder.release("r", second.epoch) and not holder.release("r", second.epoch)
    kv.assert_all_free()


def test_the_holders_abort_ends_an_unread_lease_but_leaves_a_read_to_its_notice() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, "m")
    holder = make_holder(kv)
    holder.grant("unread", kept(kv, "unread"), 0, now=0.0)
    being_read = holder.grant("read", kept(kv, "read", 6), 0, now=0.0)
    holder.on_notification(notice(NoticeKind.BEGIN, "read", being_read.epoch), now=1.0)
    holder.abort("unread")
    holder.abort("read")  # a READ may be in flight into those blocks: they stay
    holder.abort("never-leased")
    assert kv.kept.block_ids().keys() == {"read"}
    holder.check_integrity(kv.kept.block_ids())
    holder.on_notification(notice(NoticeKind.DONE, "read", being_read.epoch), now=2.0)
    kv.assert_all_free()


def test_expiry_on_the_holders_clock_frees_the_blocks(caplog: pytest.LogCaptureFixture) -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, "m")
    holder = make_holder(kv)
    holder.grant("idle", kept(kv, "idle"), 0, now=0.0)
    read = holder.grant("read", kept(kv, "read", 6), 0, now=0.0)
    holder.on_notification(notice(NoticeKind.BEGIN, "read", read.epoch), now=5.0)
    with caplog.at_level(logging.WARNING):
        assert [lease.req_id for lease in holder.expire(now=LEASE_S)] == ["idle"]
        assert holder.expire(now=5.0 + LEASE_S - 0.1) == []  # BEGIN extended it
        assert [lease.req_id for lease in holder.expire(now=5.0 + LEASE_S)] == ["read"]
    assert "lease of idle expired" in caplog.text
    assert holder.leases.num_expired == 2
    kv.assert_all_free()


def test_blocks_no_reader_will_read_are_dropped_and_count_as_stranded_until_then() -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, "m")
    holder = make_holder(kv)
    kept(kv, "ended")  # its first token ended every choice: no lease
    assert holder.num_stranded(kv.kept.block_ids()) == 3
    wrong = holder.grant("other", (1, 2), 0, now=0.0)
    with pytest.raises(AssertionError, match="the engine keeps"):
        holder.check_integrity(kv.kept.block_ids())  # a lease on blocks the engine never kept
    assert holder.drop("ended") and not holder.drop("ended")
    assert not holder.release("other", wrong.epoch)  # the lease ends; no blocks to free
    kv.assert_all_free()


def test_host_leased_blocks_are_counted_and_garbage_notices_ignored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kv = KVCacheManager(8, BLOCK_SIZE, "m", host_tier=HostTier(4), keep_on_host=True)
    holder = make_holder(kv)
    req = Request("r", list(range(1, 11)))
    kv.allocate(req, 10)
    req.num_computed_tokens = 10
    kv.cache_full_blocks(req)
    kv.owed.drain_offloads()
    blocks = kv.keep(req)
    lease = holder.grant("r", blocks.block_ids, blocks.num_host_blocks, now=0.0)
    assert holder.num_host_leased_blocks == 2
    with caplog.at_level(logging.WARNING):
        holder.on_notification(Notification("reader", b"not a notice"), now=1.0)
        holder.on_notification(notice(NoticeKind.BEGIN, "r", lease.epoch), now=1.0)
        holder.on_notification(notice(NoticeKind.BEGIN, "r", lease.epoch), now=1.5)  # illegal
    assert caplog.text.count("ignored a notification from reader") == 2
    assert holder.release("r", lease.epoch)
    kv.assert_all_free()
