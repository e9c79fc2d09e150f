"""deploy/progress.follow alone, over a controller handle that raises as Ray's does when the
controller's process died (the out-of-memory killer took it while workers joined): one line
naming why (serve and `kvrelay scale` print it and exit 1), not Ray's traceback."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, OutOfMemoryError

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
