"""Following the controller until the pools reach their size, printing each worker's transitions
as they happen (`kvrelay serve` start-up, `kvrelay scale`). Holds no state between calls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ray.exceptions import RayError

from common.cluster_state import ClusterStatus
from common.worker_actors import ControllerActor

POLL_S = 0.5
MIN_ANSWER_S = 1.0  # follow's first status call, however little of its time is left


class ScaleFailed(RuntimeError):
    """The controller cannot reach the desired size (workers keep failing to start)."""


async def follow(
    controller: ControllerActor,
    progress: Callable[[str], None],
    timeout_s: float = 1800.0,
    seen: set[tuple[str, int]] | None = None,
    wanted: dict[str, int] | None = None,
    said_s: float | None = None,
) -> ClusterStatus:
    """Poll status until every pool is settled; print each transition not in `seen` (pairs of
    worker id and transition index, e.g. those present before a scale). `wanted`: the sizes a
    scale asked for; ScaleFailed once another scale (or the autoscaler) changed them.
    TimeoutError after timeout_s, the controller's answers included, its message naming
    `said_s` (the command's own bound, of which timeout_s may be what is left; default
    timeout_s); the first status is given MIN_ANSWER_S at least."""
    said_s = timeout_s if said_s is None else said_s
    printed: set[tuple[str, int]] = set(seen or ())
    deadline = time.monotonic() + timeout_s
    status: ClusterStatus | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0 and status is not None:
            raise _not_there(status, said_s)
        within = left if status is not None else max(left, MIN_ANSWER_S)
        status = await ask_status(controller, within, said_s)
        for pool in status.pools:
            for worker in pool.workers:
                for i, step in enumerate(worker.transitions):
                    if (worker.worker_id, i) not in printed:
                        printed.add((worker.worker_id, i))
                        note = f"  {step.note}" if step.note else ""
                        progress(f"  {worker.worker_id:<24} {step.state.value:<9}{note}")
        if status.error:
            raise ScaleFailed(status.error)
        changed = [p for p in status.pools if p.desired != (wanted or {}).get(p.role, p.desired)]
        if changed:
            now = ", ".join(f"{p.role} {p.desired}" for p in status.pools)
            raise ScaleFailed(
                f"the wanted sizes changed while waiting (now {now}): another `kvrelay scale` "
                "or the autoscaler changed them"
            )
        if all(pool.settled for pool in status.pools):
            return status
        if time.monotonic() > deadline:
            raise _not_there(status, said_s)
        await asyncio.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))


def _not_there(status: ClusterStatus, timeout_s: float) -> TimeoutError:
    sizes = ", ".join(f"{p.role} {p.num_ready}/{p.desired}" for p in status.pools)
    return TimeoutError(f"pools not at their size after {round(timeout_s, 1):g} s ({sizes})")


async def ask_status(
    controller: ControllerActor, within_s: float, timeout_s: float, with_stats: bool = False
) -> ClusterStatus:
    """The controller's status, asked within `within_s` (TimeoutError naming `timeout_s`, the
    command's bound); ScaleFailed in one line when it died (killed, out of memory, its node
    lost)."""
    try:
        return await asyncio.wait_for(controller.status.remote(with_stats), max(within_s, 0.001))
    except TimeoutError:
        raise TimeoutError(
            f"the controller did not answer within {round(timeout_s, 1):g} s"
        ) from None
    except RayError as e:
        lines = str(e).strip().splitlines() or [""]
        raise ScaleFailed(f"the controller died ({type(e).__name__}: {lines[0]})") from e
