"""deploy/progress.follow alone, over controller handles: one that raises as Ray's does when the
controller's process died (the out-of-memory killer took it while workers joined) gives one line
naming why (serve and `kvrelay scale` print it and exit 1), not Ray's traceback; one that does
not answer ends it at its timeout; sizes another scale changed are not reported as reached."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, OutOfMemoryError

from common.cluster_state import ClusterStatus, PoolStatus, RedisStatus
from deploy.progress import ScaleFailed, follow


class DeadController:
    """status.remote() raises `error`, as a dead actor's handle does."""

    def __init__(self, error: Exception):
        self.error = error
        self.status = self

    async def remote(self, with_stats: bool) -> None:
        raise self.error


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (
            OutOfMemoryError("2 worker(s) were killed due to the node running low on memory.\n…"),
            "the controller died (OutOfMemoryError: 2 worker(s) were killed due to the node "
            "running low on memory.)",
        ),
        (ActorDiedError(), "the controller died (ActorDiedError: "),
    ],
)
def test_a_controller_that_died_ends_follow_with_one_line(error: Exception, said: str) -> None:
    with pytest.raises(ScaleFailed) as raised:
        asyncio.run(follow(DeadController(error), print))  # type: ignore[arg-type]
    assert str(raised.value).startswith(said)
    assert "\n" not in str(raised.value)


class Answering:
    """status.remote() answers `status` (after `delay_s`: an overloaded controller)."""

    def __init__(self, status: ClusterStatus, delay_s: float = 0.0):
        self.answer, self.delay_s = status, delay_s
        self.status = self

    async def remote(self, with_stats: bool) -> ClusterStatus:
        await asyncio.sleep(self.delay_s)
        return self.answer


def settled(prefill: int, decode: int) -> ClusterStatus:
    """Pools of these desired sizes and no workers (settled only at 0)."""
    pools = (PoolStatus("prefill", prefill, ()), PoolStatus("decode", decode, ()))
    return ClusterStatus("m", pools, (), RedisStatus(""))


def test_a_scale_whose_sizes_another_changed_is_not_reported_as_done() -> None:
    """`kvrelay scale --prefill 0` while another `kvrelay scale --prefill 2` ran after it."""
    with pytest.raises(ScaleFailed, match=r"changed while waiting \(now prefill 2, decode 3\)"):
        asyncio.run(follow(Answering(settled(2, 3)), print, wanted={"prefill": 0}))  # type: ignore[arg-type]
    done = asyncio.run(follow(Answering(settled(0, 0)), print, wanted={"prefill": 0}))  # type: ignore[arg-type]
    assert done.pool("prefill").desired == 0


def test_a_controller_that_does_not_answer_ends_follow_at_its_timeout() -> None:
    slow = Answering(settled(1, 1), delay_s=60)
    with pytest.raises(TimeoutError, match=r"the controller did not answer within 0\.2 s"):
        asyncio.run(follow(slow, print, timeout_s=0.2))  # type: ignore[arg-type]
    # one that answers, with pools that do not reach their size: that is what times out
    with pytest.raises(TimeoutError, match=r"pools not at their size after 0\.2 s \(prefill 0/1"):
        asyncio.run(follow(Answering(settled(1, 1)), print, timeout_s=0.2))  # type: ignore[arg-type]
    # kvrelay scale --timeout 30 with 0.2 s of it left for following: the message says 30
    with pytest.raises(TimeoutError, match=r"after 30 s"):
        asyncio.run(follow(Answering(settled(1, 1)), print, 0.2, said_s=30))  # type: ignore[arg-type]
