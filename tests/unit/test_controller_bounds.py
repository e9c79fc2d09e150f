"""The controller's refusals of a scale, alone (deploy/controller.Controller as a plain object,
no Ray; its reconcile loop is not started): a size outside an autoscaled pool's bounds (the
autoscaler would undo it), and on an embedded cluster a size past what the machine holds (the
out-of-memory killer would take the serving workers); an autoscale grow past it is held with a
note. And deploy/local_capacity measures that bound from real processes' memory."""

from __future__ import annotations

import asyncio
import os

import pytest

from common.cluster_state import (
    ClusterStatus,
    PoolStatus,
    RedisStatus,
    ScaleRequest,
    WorkerState,
    WorkerStatus,
)
from deploy.autoscale import AutoscaleConfig
from deploy.controller import Controller, ControllerConfig, refused_start
from deploy.local_capacity import capacity, worker_bytes
from deploy.worker_launch import WorkerTemplate
from engine.config import EngineConfig

REDIS = RedisStatus("")
DECODE_1_TO_3 = AutoscaleConfig(
    min_size={"prefill": 1, "decode": 1},
    max_size={"prefill": 1, "decode": 3},
    autoscaled=("decode",),
)


def controller(autoscale: AutoscaleConfig | None = None) -> Controller:
    template = WorkerTemplate(EngineConfig(model="m"), redis_url=None)
    return Controller(ControllerConfig(template, autoscale=autoscale), {"prefill": 1, "decode": 1})


def scale(c: Controller, **sizes: int) -> dict[str, int]:
    return asyncio.run(c.scale(ScaleRequest(**sizes)))


def test_an_autoscaled_pool_refuses_a_size_outside_its_bounds_a_fixed_one_takes_any() -> None:
    c = controller(DECODE_1_TO_3)
    with pytest.raises(
        ValueError, match=r"--decode 4: the decode pool is autoscaled within 1\.\.3"
    ):
        scale(c, decode=4)
    assert scale(c, decode=3) == {"prefill": 1, "decode": 3}
    assert scale(c, prefill=2) == {"prefill": 2, "decode": 3}  # not autoscaled: the operator's
    status = asyncio.run(c.status(False))
    notes = {pool.role: pool.autoscale for pool in status.pools}
    assert notes == {"prefill": "", "decode": "autoscale 1..3"}


def test_past_the_machines_capacity_a_scale_is_refused_and_a_grow_held() -> None:
    c = controller(DECODE_1_TO_3)
    why = "this machine's memory holds about 3 workers of this model"
    asyncio.run(c.set_capacity(3, why))
    assert scale(c, decode=2) == {"prefill": 1, "decode": 2}
    with pytest.raises(ValueError, match=rf"--decode 3: {why}, so at most 3 workers of both pools"):
        scale(c, decode=3)
    with pytest.raises(
        ValueError, match=r"--prefill 2 --decode 2: .*\(now prefill 2 \+ decode 2\)"
    ):
        scale(c, prefill=2, decode=2)
    assert scale(c, decode=1) == {"prefill": 1, "decode": 1}  # down: always
    assert c.resize("decode", 2, "pressure 1.5 > 1")
    assert not c.resize("decode", 3, "pressure 1.4 > 1")  # 1 + 3 > 3: held (not logged as made)
    status = asyncio.run(c.status(False))
    assert [pool.desired for pool in status.pools] == [1, 2]
    note = status.pools[1].autoscale
    assert note.startswith("autoscale 1..3, held at 2 at ") and why in note


def test_the_capacity_counts_live_workers_and_what_the_free_memory_holds_at_the_largest() -> None:
    me = os.getpid()
    rss = worker_bytes([me])
    assert rss > 0 and 1.5 * rss < worker_bytes([me, me]) < 2.5 * rss  # a TP worker: its ranks'
    assert worker_bytes([2**22 + 12345]) == 0  # no such process

    def worker(state: WorkerState, pid: int) -> WorkerStatus:
        return WorkerStatus(f"w{pid}-{state.value}", "decode", state, (), pid=pid)

    pools = (
        PoolStatus("prefill", 1, (worker(WorkerState.READY, me),)),
        PoolStatus("decode", 1, (worker(WorkerState.READY, me), worker(WorkerState.GONE, me))),
    )
    status = ClusterStatus("m", pools, (), REDIS)
    most, why = capacity(status, available=int(rss * 5.5))  # 0.8 x 5.5: 4 more (rss grows a little)
    assert most == 2 + 4
    assert f"holds about {most} workers" in why and "adds no nodes" in why
    gone = ClusterStatus(
        "m", (PoolStatus("decode", 1, (worker(WorkerState.READY, 0),)),), (), {}, ""
    )
    assert capacity(gone) is None  # no worker's memory to measure


def test_shutdown_withdraws_the_clusters_request_for_nodes(monkeypatch) -> None:
    """serve's stop: Ray's autoscaler is told the pools need nothing, so idle nodes go after
    their idle timeout instead of being kept for the last size."""
    asked: list[list[dict]] = []

    def request_resources(bundles: list[dict]) -> None:
        asked.append(bundles)

    monkeypatch.setattr("ray.autoscaler.sdk.request_resources", request_resources)
    c = controller()
    scale(c, decode=2)
    assert len(asked[-1]) == 3  # one bundle a worker: 1 prefill + 2 decode
    asyncio.run(c.shutdown())
    assert asked[-1] == []


def test_a_start_the_worker_refused_is_not_tried_again_but_a_crash_is() -> None:
    """refused_start reads the exception a worker's start raised from Ray's wrapper: the
    engine's StartRefused (a KV tier too small for a block) and CheckpointRefused end the
    pool's starts at once; anything else is retried."""
    from ray.exceptions import RayActorError

    def failed(last_line: str, init: bool = True) -> RayActorError:
        return RayActorError(error_msg=f"Traceback:\n  File x\n{last_line}", actor_init_failed=init)

    message = "disk_kv_cache_bytes: 5 bytes hold no block file (7 bytes each)"
    assert refused_start(failed(f"engine.config.StartRefused: {message}"))
    assert refused_start(failed("engine.config.CheckpointRefused: a tensor no module takes"))
    assert not refused_start(failed("RuntimeError: CUDA out of memory"))
    assert not refused_start(failed(f"engine.config.StartRefused: {message}", init=False))
