"""WorkerLifecycle: a worker's state as the controller set it, whether it still takes requests,
and what it saw of user traffic (its request count, first request, when it turned ready)."""

from __future__ import annotations

import time

from common.cluster_state import WARMUP_REQ_PREFIX, WorkerState, WorkerUnavailable


class WorkerLifecycle:
    """Invariants: `ready_at` is the worker's own clock at the moment its state first went
    ready, so a user request recorded before it (`first_request_at`) shows a placement too early;
    `stopped` implies `closed`. Engine-thread only, except reads of the fields."""

    def __init__(self, worker_id: str, role: str):
        self.worker_id = worker_id
        self.role = role
        self.state = WorkerState.JOINING
        self.ready_at: float | None = None
        self.first_request_at: float | None = None
        self.num_requests = 0
        self.closed = False  # takes no more requests (retired by a drain, or shut down)
        self.stopped = False  # shut down: engine stopped, withdrawn from the index

    def set_state(self, state: WorkerState) -> float:
        """Switch state (the caller publishes it); returns when, on this worker's clock."""
        self.state = WorkerState(state)
        now = time.time()
        if self.state == WorkerState.READY and self.ready_at is None:
            self.ready_at = now
        return now

    def check_open(self) -> None:
        """Raise WorkerUnavailable once the worker has shut down or retired."""
        if self.closed:
            raise WorkerUnavailable(
                f"{self.role} worker {self.worker_id} has stopped taking requests (retired or "
                "shut down)"
            )

    def admit(self, req_id: str) -> None:
        """A request arrives: refuse it once closed; count it unless it is a warm-up."""
        if self.closed:
            raise WorkerUnavailable(f"worker {self.worker_id} has stopped taking requests")
        if not self.is_user_request(req_id):
            return
        self.num_requests += 1
        if self.first_request_at is None:
            self.first_request_at = time.time()

    def close(self) -> None:
        """Stop taking requests (a late one gets WorkerUnavailable: the router places it
        elsewhere)."""
        self.closed = True

    def stop(self) -> bool:
        """Shut down: closed and stopped. False when it was stopped already (shut down once)."""
        if self.stopped:
            return False
        self.closed = self.stopped = True
        return True

    def is_user_request(self, req_id: str) -> bool:
        return not req_id.startswith(WARMUP_REQ_PREFIX)
