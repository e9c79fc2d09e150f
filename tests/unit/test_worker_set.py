"""WorkerSet: the router's own placement accounting and dead-worker exclusion (no Ray calls:
actors are plain objects here, so only the bookkeeping is under test)."""

from __future__ import annotations

from common.messages import WorkerInfo, WorkerLoad
from router.policy import choose_decode
from router.worker_set import WorkerSet


def idle(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id, "decode", worker_id, load=WorkerLoad(free_blocks=100))


def test_a_burst_alternates_before_any_load_is_published() -> None:
    workers = WorkerSet()
    published = [idle("d0"), idle("d1")]  # stale: both look idle for the whole burst
    chosen = []
    for _ in range(8):
        worker = choose_decode(workers.with_placed(published), num_blocks_needed=4)
        workers.place(worker.worker_id)
        chosen.append(worker.worker_id)
    assert chosen.count("d0") == chosen.count("d1") == 4


def test_published_load_wins_when_it_is_higher_and_done_undoes_place() -> None:
    workers = WorkerSet()
    busy = WorkerInfo("p0", "prefill", load=WorkerLoad(running=5, queued_tokens=900))
    workers.place("p0", num_tokens=100)
    (seen,) = workers.with_placed([busy])
    assert (seen.load.running + seen.load.waiting, seen.load.queued_tokens) == (5, 900)
    workers.place("p0", num_tokens=2000)
    (seen,) = workers.with_placed([busy])
    assert seen.load.queued_tokens == 2100
    workers.done("p0", 100)
    workers.done("p0", 2000)
    assert workers.num_placed("p0") == 0
    assert workers.with_placed([busy]) == [busy]


def test_a_dead_worker_leaves_placement_at_once() -> None:
    workers = WorkerSet()
    workers.add("d0", "decode", object(), "d0")
    workers.add("d1", "decode", object(), "d1")
    workers.place("d0")
    workers.mark_dead("d0")
    assert [w.worker_id for w in workers.known("decode")] == ["d1"]
    assert workers.is_dead("d0") and workers.num_placed("d0") == 0
    workers.done("d0")  # a stream of the dead worker ending later changes nothing
    assert workers.num_placed("d0") == 0


def test_controller_membership_decides_which_known_workers_take_placements() -> None:
    from common.cluster_state import Member, WorkerState

    workers = WorkerSet()
    for worker_id in ("d0", "d1", "d2"):
        workers.add(worker_id, "decode", object(), worker_id, state="joining")
    assert workers.known("decode") == []  # none is ready yet
    workers.sync(
        [
            Member("d0", "decode", "d0", WorkerState.READY),
            Member("d1", "decode", "d1", WorkerState.DRAINING),
        ]
    )
    assert [w.worker_id for w in workers.known("decode")] == ["d0"]
    assert sorted(workers.actors("decode")) == ["d0", "d1"]  # d2 left the membership
