"""A lost Ray cluster does not look healthy. A real `kvrelay serve` whose raylet is killed: /ready
turns 503 within seconds, naming the cause, with no worker counted in either pool; requests get
503 with a clear message (code "unavailable", no Retry-After) and no traceback in the log; serve
says so in one line and exits 1, leaving no process of its cluster behind. And a router whose
controller is gone still follows the workers: those found dead leave their pools, and a request
then gets 503 "unavailable" with a Retry-After (in-process cluster: real Ray, Redis, SmolLM2)."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest
import ray

from common.messages import GenerateRequest
from deploy.local_cluster import LocalCluster
from engine.sampling.sampling_params import SamplingParams
from router.serving_gate import ClusterUnavailable
from tests.integration.cluster_support import cluster_spec
from tests.integration.serve_process import CHAT, ServeProcess

LOST_WINDOW_S = 10  # --drain-seconds: how long a serve whose Ray is lost answers 503
READY_BOUND_S = 30  # a bound on the poll only (measured: under a second)


def test_a_killed_raylet_turns_ready_to_503_and_serve_exits_1(tmp_path):
    serve = ServeProcess(tmp_path, "--drain-seconds", str(LOST_WINDOW_S))
    try:
        serve.wait_for("Ctrl-C to stop")
        assert serve.get("/ready")[0] == 200
        processes = serve.cluster_processes()
        raylet = serve.raylet()
        raylet.kill()  # this serve's own raylet, found among its descendants

        ready = serve.until_status("/ready", 503, bound_s=READY_BOUND_S)
        assert ready["reason"] == f"the Ray cluster is lost: its raylet (pid {raylet.pid}) exited"
        assert ready["prefill_workers"] == 0 and ready["decode_workers"] == 0
        for _ in range(3):
            reply = serve.request("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 4})
            assert reply.status == 503, reply.body
            assert "the Ray cluster is lost" in reply.body["error"]["message"], reply.body
            assert reply.body["error"]["code"] == "unavailable", reply.body  # not overloaded
            assert "Retry-After" not in reply.headers  # it exits: no retry here helps
        assert serve.wait_exit(LOST_WINDOW_S + 60) == 1
    finally:
        serve.kill()
    output = serve.output()
    lost = [line for line in output.splitlines() if line.startswith("kvrelay: the Ray cluster")]
    assert lost == [
        f"kvrelay: the Ray cluster is lost: its raylet (pid {raylet.pid}) exited; stopping "
        "with exit status 1"
    ], output
    assert "Traceback" not in output, output
    left = [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [(p.pid, p.name()) for p in left]


@pytest.fixture
def cluster(loop):
    spec = cluster_spec(num_prefill=1, num_decode=1)
    cluster = loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


def test_without_its_controller_a_router_still_follows_its_workers(cluster, loop):
    """The controller goes, and its workers with it (Ray ends the actors an actor owns): its
    membership, the router's usual source, can say nothing any more. The router asks the
    workers itself, and readiness follows (it used to count both as ready for good)."""
    backend = cluster.backend

    async def run() -> dict[str, object]:
        assert (await backend.health())["ok"]
        ray.kill(cluster.controller, no_restart=True)
        deadline = time.monotonic() + READY_BOUND_S
        while (health := await backend.health())["prefill_workers"] or health["decode_workers"]:
            assert time.monotonic() < deadline, health
            await asyncio.sleep(0.1)
        return health

    health = loop.run_until_complete(run())
    assert health == {"ok": False, "prefill_workers": 0, "decode_workers": 0, "redis": "ok"}
    # serve stops with status 1 on it, as on a lost Ray (it used to answer 503 for good)
    assert "its workers ended with it" in (cluster.lost() or ""), cluster.lost()
    # A request now finds no worker: 503 "unavailable" with a Retry-After (one may come back).
    request = GenerateRequest("no-worker", (1, 2, 3), SamplingParams(max_tokens=4))
    with pytest.raises(ClusterUnavailable, match="no worker can take the request now") as info:
        loop.run_until_complete(anext(backend.generate(request)))
    assert (info.value.code, info.value.retry_after_s) == ("unavailable", 1)
    cluster.controller = None  # killed above: close() skips it
