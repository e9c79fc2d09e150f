"""Resizing both pools while a steady load runs, through the `kvrelay scale` and `kvrelay status`
commands (real subprocesses against this test's Ray cluster; real Redis, NIXL, SmolLM2)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import ray

from common.cluster_state import ClusterStatus, WorkerState, WorkerStatus
from common.messages import GenerateRequest, TokenDelta
from deploy.local_cluster import LocalCluster
from engine.sampling.sampling_params import SamplingParams
from tests.integration.cluster_support import (
    cluster_spec,
    reference_batch,
    tokens_of,
    wait_until_no_leaks,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
RATE_PER_S = 2.0  # sized for 2 CPU cores: a request lasts about a second
NUM_PROMPTS = 12
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(loop):
    spec = cluster_spec(num_prefill=1, num_decode=1, drain_grace_s=1.0)
    cluster = loop.run_until_complete(LocalCluster(spec).start(progress=lambda m: None))
    yield cluster
    loop.run_until_complete(cluster.close())


async def kvrelay(*args: str) -> tuple[int, str, str]:
    """Run the `kvrelay` CLI in its own process against this test's Ray cluster."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    address = ray.get_runtime_context().gcs_address
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "deploy.cli",
        *args,
        "--address",
        address,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 600)
    return proc.returncode or 0, out.decode(), err.decode()


class SteadyLoad:
    """Requests at a fixed rate, cycling over the prompts; every stream's deltas are kept."""

    def __init__(self, backend, prompts: list[list[int]]):
        self.backend = backend
        self.prompts = prompts
        self.results: dict[str, tuple[int, list[TokenDelta]]] = {}
        self.failures: list[str] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._done = asyncio.Event()
        self._stop = asyncio.Event()

    async def run(self) -> None:
        i = 0
        while not self._stop.is_set():
            self._tasks.append(asyncio.create_task(self._one(f"load{i}", i % len(self.prompts))))
            i += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), 1 / RATE_PER_S)
        await asyncio.gather(*self._tasks)

    async def _one(self, req_id: str, prompt_index: int) -> None:
        request = GenerateRequest(req_id, tuple(self.prompts[prompt_index]), GREEDY)
        try:
            deltas = [d async for d in self.backend.generate(request)]
            self.results[req_id] = (prompt_index, deltas)
        except Exception as e:
            self.failures.append(f"{req_id}: {type(e).__name__}: {e}")
        self._done.set()

    async def wait_for_more(self, num: int) -> None:
        """Until `num` more requests have ended (load is flowing across the change)."""
        target = len(self.results) + len(self.failures) + num
        while len(self.results) + len(self.failures) < target:
            self._done.clear()
            await self._done.wait()

    def stop(self) -> None:
        self._stop.set()


async def status_of(cluster: LocalCluster) -> ClusterStatus:
    return await cluster.controller.status.remote()


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


def ready_at(worker: WorkerStatus) -> float:
    return next(t.at for t in worker.transitions if t.state == WorkerState.READY)


def test_resizing_both_pools_under_load_loses_nothing(cluster, loop, tokenizer, make_engine):
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": f"Name a fruit, number {i}."}])
        for i in range(NUM_PROMPTS)
    ]
    expected = reference_batch(make_engine, prompts, GREEDY)

    async def served_some(worker_id: str) -> bool:
        status = await status_of(cluster)
        worker = next(w for p in status.pools for w in p.workers if w.worker_id == worker_id)
        return worker.stats is not None and worker.stats.num_requests > 0

    async def scenario() -> tuple[SteadyLoad, list[dict]]:
        load = SteadyLoad(cluster.backend, prompts)
        runner = asyncio.create_task(load.run())
        snapshots = []
        await load.wait_for_more(2)
        # `--no-wait` returns at once, and status shows the new worker joining straight away.
        rc, _, err = await kvrelay("scale", "--decode", "2", "--no-wait")
        assert rc == 0, err
        rc, out, err = await kvrelay("status", "--json")
        assert rc == 0, err
        snapshots.append(json.loads(out))
        rc, _, err = await kvrelay("scale", "--decode", "2")  # waits until it is ready
        assert rc == 0, err
        rc, out, err = await kvrelay("status", "--json")
        snapshots.append(json.loads(out))
        await until(lambda: served_some("kvrelay-decode-1"), "the new decode worker to serve")
        rc, _, scale_down_log = await kvrelay("scale", "--decode", "1")
        assert rc == 0, scale_down_log
        await load.wait_for_more(2)
        rc, _, err = await kvrelay("scale", "--prefill", "2")
        assert rc == 0, err
        await until(lambda: served_some("kvrelay-prefill-1"), "the new prefill worker to serve")
        rc, _, err = await kvrelay("scale", "--prefill", "1")
        assert rc == 0, err
        await load.wait_for_more(2)
        load.stop()
        await runner
        snapshots.append({"scale_down_log": scale_down_log})
        return load, snapshots

    load, snapshots = loop.run_until_complete(scenario())

    # Nothing failed, and every output is the undisturbed engine's, token for token.
    assert not load.failures, load.failures
    assert len(load.results) >= 10
    for req_id, (prompt_index, deltas) in load.results.items():
        assert deltas[-1].finish_reason == "length", (req_id, deltas[-1])
        assert tokens_of(deltas) == expected[prompt_index], req_id

    # Status followed the resize: desired 2 with a joining worker at once, then 2 ready.
    joining, settled = snapshots[0], snapshots[1]
    decode_pool = next(p for p in joining["pools"] if p["role"] == "decode")
    assert decode_pool["desired"] == 2
    assert any(w["state"] == "joining" for w in decode_pool["workers"]), decode_pool
    decode_pool = next(p for p in settled["pools"] if p["role"] == "decode")
    assert decode_pool["num_ready"] == 2
    assert "draining" in snapshots[2]["scale_down_log"] and "gone" in snapshots[2]["scale_down_log"]

    final = loop.run_until_complete(status_of(cluster))
    for pool in final.pools:
        assert pool.settled and pool.num_ready == 1, pool
        for worker in pool.workers:
            states = [t.state for t in worker.transitions]
            assert WorkerState.READY in states, worker
            # No user request reached a worker before it turned ready.
            stats = worker.stats
            assert stats is not None, worker.worker_id
            if stats.first_request_at is not None:
                assert stats.first_request_at >= ready_at(worker), worker.worker_id
        drained = [w for w in pool.workers if w.state == WorkerState.GONE]
        assert [w.worker_id for w in drained] == [f"kvrelay-{pool.role}-1"]
        # The drained worker served traffic, then left with every block free.
        (gone,) = drained
        assert gone.stats is not None and gone.stats.num_requests > 0
        assert gone.exit_check is not None and gone.exit_check.clean, gone.exit_check
        assert [t.state for t in gone.transitions][-3:] == [
            WorkerState.READY,
            WorkerState.DRAINING,
            WorkerState.GONE,
        ]
    loop.run_until_complete(wait_until_no_leaks(cluster))
