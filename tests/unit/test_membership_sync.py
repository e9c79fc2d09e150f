"""MembershipSync.announce: a router's new addresses reach the controller at once, not at the
next interval, and a controller that does not answer is no error (a stand-in controller: the
class under test makes one call on it)."""

from __future__ import annotations

import asyncio

from common.cluster_state import RouterStatus
from router.membership import MembershipSync
from router.worker_set import WorkerSet


class Members:
    """The controller's `members` remote method: records what each call told it."""

    def __init__(self, fail: bool = False) -> None:
        self.told: list[RouterStatus] = []
        self.fail = fail

    def remote(self, router: RouterStatus) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        if self.fail:
            future.set_exception(ConnectionError("controller gone"))
        else:
            self.told.append(router)
            future.set_result([])
        return future


class Controller:
    def __init__(self, fail: bool = False) -> None:
        self.members = Members(fail)


def test_announce_tells_the_controller_the_servers_addresses_at_once() -> None:
    controller = Controller()
    sync = MembershipSync(controller, WorkerSet(), RouterStatus("r1"), interval_s=3600)
    serving = RouterStatus("r1", "http://127.0.0.1:8000/v1", "127.0.0.1:50051")
    asyncio.run(sync.announce(serving))
    assert [r.http_url for r in controller.members.told] == ["http://127.0.0.1:8000/v1"]
    assert controller.members.told[0].grpc_address == "127.0.0.1:50051"
    assert sync.router == serving  # later syncs carry it too


def test_announce_to_a_controller_that_does_not_answer_keeps_the_addresses() -> None:
    controller = Controller(fail=True)
    sync = MembershipSync(controller, WorkerSet(), RouterStatus("r1"), interval_s=3600)
    serving = RouterStatus("r1", "http://127.0.0.1:8000/v1", "127.0.0.1:50051")
    asyncio.run(sync.announce(serving))  # no exception: the periodic sync retries
    assert sync.router == serving
