"""The KV handoff's state machines (kvtransfer/handoff.py, leases.py, pulls.py): every legal
path, illegal moves refused, epoch fencing, expiry and the being-read extension on a clock passed
in, counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtransfer.base import TransferHandle
from kvtransfer.handoff import DEADLINE_MARGIN, NONCE_BITS, HandoffError, Notice, NoticeKind
from kvtransfer.leases import LEASE_TRANSITIONS, LeaseLedger, LeaseState
from kvtransfer.pulls import PULL_TRANSITIONS, PullLedger, PullState

L, P = LeaseState, PullState
BLOCKS = (4, 5, 6)


def counts(ledger: LeaseLedger | PullLedger) -> dict[str, int]:
    return {t.name: t.count for t in ledger.transitions() if t.count}


def xfer(n: int = 0) -> TransferHandle:
    return TransferHandle(n, "holder", 3, 1)


# ---- the tables ---------------------------------------------------------------------------


@pytest.mark.parametrize("table", [LEASE_TRANSITIONS, PULL_TRANSITIONS])
def test_tables_start_once_and_end_in_terminal_states(table) -> None:
    states = set(next(iter(table[None])).__class__)
    assert len(table[None]) == 1
    reachable = {dst for dsts in table.values() for dst in dsts}
    assert reachable == states  # every state can be reached
    terminal = states - set(table)
    assert terminal and all(s not in dsts for s, dsts in table.items() if s in terminal)


# ---- prefill side: LeaseLedger ------------------------------------------------------------


def granted(lease_s: float = 10.0, now: float = 100.0) -> tuple[LeaseLedger, int]:
    ledger = LeaseLedger(nonce=7)
    lease = ledger.grant("r", BLOCKS, lease_s, now)
    assert (lease.state, lease.expires_at, lease.cap_at) == (L.HELD, now + lease_s, now + 20)
    ledger.check_integrity({"r": BLOCKS})
    return ledger, lease.epoch


def test_held_then_released() -> None:
    ledger, epoch = granted()
    assert ledger.num_blocks(L.HELD) == 3
    ended = ledger.release("r", epoch)
    assert ended is not None and ended.state is L.RELEASED and ended.block_ids == BLOCKS
    assert ledger.num_live == 0 and ledger.num_blocks(L.HELD) == 0
    assert counts(ledger) == {"new->held": 1, "held->released": 1}
    ledger.check_integrity({})


def test_held_then_being_read_then_released_by_the_done_notice() -> None:
    ledger, epoch = granted()
    reading = ledger.begin_read("r", epoch, now=101.0)
    assert reading is not None and reading.state is L.BEING_READ
    assert ledger.num_blocks(L.BEING_READ) == 3 and ledger.num_blocks(L.HELD) == 0
    ledger.check_integrity({"r": BLOCKS})
    assert ledger.release("r", epoch) is not None
    assert counts(ledger) == {"new->held": 1, "held->being_read": 1, "being_read->released": 1}
    ledger.check_integrity({})


def test_expiry_runs_on_the_clock_passed_in() -> None:
    ledger, _ = granted(lease_s=10.0, now=100.0)
    assert ledger.expire(109.999) == []
    (expired,) = ledger.expire(110.0)
    assert expired.state is L.EXPIRED and expired.req_id == "r"
    assert ledger.num_expired == 1 and ledger.num_live == 0
    assert counts(ledger) == {"new->held": 1, "held->expired": 1}
    ledger.check_integrity({})


def test_a_read_extends_the_lease_by_lease_s_from_its_start() -> None:
    ledger, epoch = granted(lease_s=10.0, now=100.0)
    lease = ledger.begin_read("r", epoch, now=105.0)
    assert lease is not None and lease.expires_at == 115.0
    assert ledger.expire(114.9) == []
    (expired,) = ledger.expire(115.0)
    assert ledger.num_expired == 1 and counts(ledger)["being_read->expired"] == 1
    assert expired.block_ids == BLOCKS


def test_the_extension_stops_at_the_cap_and_never_shortens() -> None:
    ledger, epoch = granted(lease_s=10.0, now=100.0)
    late = ledger.begin_read("r", epoch, now=112.0)  # came before expire() ran: honoured
    assert late is not None and late.expires_at == 120.0 == late.cap_at
    ledger.check_integrity({"r": BLOCKS})
    assert ledger.expire(119.99) == [] and len(ledger.expire(120.0)) == 1

    ledger, epoch = granted(lease_s=10.0, now=100.0)
    early = ledger.begin_read("r", epoch, now=100.0)
    assert early is not None and early.expires_at == 110.0


def test_a_stale_release_is_ignored_counted_and_spares_a_later_grant() -> None:
    ledger, first = granted()
    assert ledger.release("r", first) is not None
    second = ledger.grant("r", (9, 10), 10.0, now=200.0).epoch  # re-prefill of the same req_id
    assert second != first

    assert ledger.release("r", first) is None  # the late release of the first grant
    assert ledger.begin_read("r", first, now=201.0) is None  # and a late BEGIN of it
    assert ledger.num_stale == 2
    lease = ledger.lease("r")
    assert lease is not None and lease.epoch == second and lease.state is L.HELD
    assert ledger.num_blocks(L.HELD) == 2
    ledger.check_integrity({"r": (9, 10)})

    assert ledger.release("r", second) is not None
    assert ledger.release("r", second) is None  # a duplicate is stale too
    assert ledger.num_stale == 3 and ledger.num_live == 0


def test_illegal_lease_moves_are_refused() -> None:
    ledger, epoch = granted()
    with pytest.raises(HandoffError, match="already leased"):
        ledger.grant("r", BLOCKS, 10.0, 100.0)
    ledger.begin_read("r", epoch, 101.0)
    with pytest.raises(HandoffError, match="being_read -> being_read"):
        ledger.begin_read("r", epoch, 102.0)
    with pytest.raises(ValueError, match="lease_s"):
        ledger.grant("q", BLOCKS, 0.0, 100.0)
    ledger.check_integrity({"r": BLOCKS})  # a refused move changed nothing


def test_the_holders_abort_spares_a_lease_being_read() -> None:
    ledger, epoch = granted()
    assert ledger.revoke("nobody") is None
    ledger.begin_read("r", epoch, 101.0)
    assert ledger.revoke("r") is None and ledger.num_live == 1  # a READ may be in flight
    assert ledger.release("r", epoch) is not None
    ledger, _ = granted()
    revoked = ledger.revoke("r")
    assert revoked is not None and revoked.state is L.RELEASED and ledger.num_stale == 0


def test_epochs_are_unique_and_carry_the_ledgers_nonce() -> None:
    ledger = LeaseLedger(nonce=3)
    epochs = []
    for i in range(50):
        epochs.append(ledger.grant(f"r{i}", (i,), 1.0, 0.0).epoch)
        ledger.release(f"r{i}", epochs[-1])
    assert len(set(epochs)) == 50 and all(e >> 32 == 3 for e in epochs)
    other = LeaseLedger(nonce=4).grant("r0", (0,), 1.0, 0.0).epoch
    assert other not in epochs  # a restarted worker's first epoch is not its predecessor's
    assert LeaseLedger().grant("r", (), 1.0, 0.0).epoch >> 32 < 1 << NONCE_BITS


def test_stranded_blocks_are_held_blocks_no_lease_accounts_for() -> None:
    ledger, _ = granted()
    assert ledger.num_stranded({"r": BLOCKS}) == 0
    assert ledger.num_stranded({"r": BLOCKS, "lost": (1, 2)}) == 2
    assert ledger.num_stranded({"r": (*BLOCKS, 8)}) == 1
    with pytest.raises(AssertionError, match="the engine keeps"):
        ledger.check_integrity({})  # a lease on blocks the engine does not hold


# ---- decode side: PullLedger --------------------------------------------------------------


def queued(lease_s: float = 10.0, received_at: float = 1000.0) -> PullLedger[str]:
    ledger: PullLedger[str] = PullLedger()
    pull = ledger.queue("r", 42, lease_s, received_at, payload="the request")
    assert pull.state is P.QUEUED and pull.payload == "the request" and pull.epoch == 42
    ledger.check_integrity({})
    return ledger


def test_pull_queued_reserved_reading_committed() -> None:
    ledger = queued()
    ledger.reserve("r", (1, 2))
    assert ledger.num_blocks(P.RESERVED) == 2
    ledger.check_integrity({"r": [0, 1, 2]})  # block 0 reused from the local prefix cache
    pull = ledger.start_reading("r", xfer(), now=1001.0)
    assert pull.state is P.READING and pull.read_by == 1011.0
    assert ledger.num_blocks(P.READING) == 2 and ledger.num_blocks(P.RESERVED) == 0
    assert [p.req_id for p in ledger.in_state(P.READING)] == ["r"]
    ledger.check_integrity({"r": [0, 1, 2]})
    assert ledger.commit("r").state is P.COMMITTED
    assert ledger.num_live == 0
    assert counts(ledger) == {
        "new->queued": 1,
        "queued->reserved": 1,
        "reserved->reading": 1,
        "reading->committed": 1,
    }
    ledger.check_integrity({})


@pytest.mark.parametrize(
    ("moves", "end"),
    [
        (["reserve"], "commit"),  # every block reused locally: nothing to read
        (["reserve", "read"], "fail"),  # the READ failed: recompute
        (["reserve"], "fail"),  # peer unavailable, or too late to read
        ([], "fail"),  # the engine refused the request
        ([], "abort"),
        (["reserve"], "abort"),
        (["reserve", "read"], "abort"),
    ],
)
def test_every_other_pull_path(moves: list[str], end: str) -> None:
    ledger = queued()
    loading: dict[str, list[int]] = {}
    for move in moves:
        if move == "reserve":
            ledger.reserve("r", (1,))
            loading = {"r": [1]}
        else:
            ledger.start_reading("r", xfer(), now=1001.0)
        ledger.check_integrity(loading)
    pull = getattr(ledger, end)("r")
    assert pull is not None and pull.state == {"commit": P.COMMITTED, "fail": P.FAILED}.get(
        end, P.ABORTED
    )
    assert ledger.num_live == 0 and ledger.abort("r") is None
    assert sum(t.count for t in ledger.transitions()) == len(moves) + 2
    ledger.check_integrity({})


def test_illegal_pull_moves_are_refused() -> None:
    ledger = queued()
    with pytest.raises(HandoffError, match="already being pulled"):
        ledger.queue("r", 43, 10.0, 1000.0, payload="again")
    with pytest.raises(HandoffError, match="queued -> reading"):
        ledger.start_reading("r", xfer(), now=1001.0)
    with pytest.raises(HandoffError, match="queued -> committed"):
        ledger.commit("r")
    ledger.reserve("r", (1,))
    with pytest.raises(HandoffError, match="reserved -> reserved"):
        ledger.reserve("r", (1,))
    ledger.fail("r")
    with pytest.raises(HandoffError, match="no pull in flight"):
        ledger.commit("r")
    with pytest.raises(ValueError, match="lease_s"):
        ledger.queue("q", 1, -1.0, 1000.0, payload="")
    ledger.check_integrity({})


def test_the_read_deadline_is_reckoned_on_the_readers_clock() -> None:
    ledger = queued(lease_s=10.0, received_at=1000.0)
    pull = ledger.reserve("r", (1,))
    assert pull.deadline == 1000.0 + (1 - DEADLINE_MARGIN) * 10.0
    assert pull.read_window_open(pull.deadline - 0.01)
    assert not pull.read_window_open(pull.deadline)
    with pytest.raises(HandoffError, match="too late to read"):
        ledger.start_reading("r", xfer(), now=pull.deadline)
    assert ledger.pull("r").state is P.RESERVED  # type: ignore[union-attr]
    no_time = queued(lease_s=0.0).reserve("r", (1,))  # a handle with no lease left
    assert not no_time.read_window_open(no_time.received_at)


def test_queued_pulls_keep_their_arrival_order_and_hold_no_blocks() -> None:
    ledger: PullLedger[int] = PullLedger()
    for i in range(4):
        ledger.queue(f"r{i}", i, 10.0, float(i), payload=i)
    ledger.reserve("r1", (7,))
    assert [p.req_id for p in ledger.in_state(P.QUEUED)] == ["r0", "r2", "r3"]
    assert ledger.num_blocks(P.QUEUED) == 0


def test_stranded_blocks_are_loading_blocks_no_pull_accounts_for() -> None:
    ledger = queued()
    assert ledger.num_stranded({}) == 0
    assert ledger.num_stranded({"r": [1, 2]}) == 2  # loading, but its pull never reserved
    with pytest.raises(AssertionError):
        ledger.check_integrity({"r": [1, 2]})
    ledger.reserve("r", (2,))
    assert ledger.num_stranded({"r": [1, 2]}) == 0
    assert ledger.num_stranded({"r": [1, 2], "gone": [3]}) == 1
    with pytest.raises(AssertionError, match="not held"):
        ledger.check_integrity({})  # a reservation of blocks the engine does not hold


# ---- notices ------------------------------------------------------------------------------


def test_notices_round_trip_and_refuse_foreign_messages() -> None:
    for notice in (
        Notice(NoticeKind.BEGIN, "req 1:a", 7 << 32 | 1),
        Notice(NoticeKind.DONE, "r", 1),
    ):
        assert Notice.decode(notice.encode()) == notice
    for msg in (b"req-1", b"kvr-handoff begin x r", b"kvr-handoff nudge 1 r", b"other done 1 r"):
        with pytest.raises(ValueError):
            Notice.decode(msg)


def test_the_module_is_torch_free() -> None:
    modules = "kvtransfer.handoff, kvtransfer.leases, kvtransfer.pulls, kvtransfer.kv_holder"
    code = f"import sys, {modules}; assert 'torch' not in sys.modules, 'torch imported'"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
