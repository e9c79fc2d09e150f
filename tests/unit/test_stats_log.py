"""The periodic stats line: what it says of an interval, and that it is silent while idle (pure
functions over samples; the router's totals from a real RouterMetrics)."""

from __future__ import annotations

import asyncio

from common.cluster_state import ClassQueue, DecodeStats, PrefillStats, WorkerState
from common.messages import WorkerLoad
from router.fair_queue import FairQueue, Ticket
from router.metrics import RouterMetrics, RouterTotals
from router.stats_log import StatsSample, WorkerSample, is_busy, sample_of, stats_line
from router.traffic_class import KeyClass, TrafficClass

IDLE_LOAD = WorkerLoad(free_blocks=100, total_blocks=100)


def sample(
    at_s: float,
    streamed: int = 0,
    finished: int = 0,
    in_flight: int = 0,
    workers: dict[str, WorkerSample] | None = None,
) -> StatsSample:
    workers = workers or {
        "p0": WorkerSample("prefill", IDLE_LOAD, 0, 0),
        "d0": WorkerSample("decode", IDLE_LOAD, 0, 0),
    }
    return StatsSample(at_s, RouterTotals(streamed, finished, in_flight), workers)


def test_a_busy_interval_gives_throughput_requests_and_each_pools_kv_use_and_hits() -> None:
    before = sample(100.0, streamed=50, finished=3)
    now = sample(
        110.0,
        streamed=250,
        finished=8,
        in_flight=2,
        workers={
            "p0": WorkerSample("prefill", IDLE_LOAD, 1000, 400),
            "d0": WorkerSample("decode", WorkerLoad(2, 1, 60, 100), 0, 0),
            "d1": WorkerSample("decode", WorkerLoad(1, 0, 90, 100), 0, 0),
        },
    )
    assert stats_line(before, now) == (
        "stats: prompt 100.0 tok/s, generation 20.0 tok/s, 0.50 req/s, in flight 2"
        " | prefill (1 worker): running 0, waiting 0, KV 0.0%, prefix hits 40%"
        " | decode (2 workers): running 3, waiting 1, KV 25.0%"
    )


def test_a_worker_that_did_not_answer_in_time_is_said_not_to_be_gone() -> None:
    """A busy CPU worker can miss the 2 s stats call: the line said "prefill (0 workers)"."""
    before = sample(100.0, streamed=50)
    now = sample(110.0, streamed=250, in_flight=1)
    silent = StatsSample(now.at_s, now.router, {"d0": now.workers["d0"]}, {"prefill": 1})
    line = stats_line(before, silent)
    assert line is not None and "prefill (0 workers, 1 not answering)" in line, line
    assert "decode (1 worker):" in line


def test_silent_while_idle_and_one_line_after_the_last_busy_interval() -> None:
    idle = sample(0.0)
    assert stats_line(idle, sample(10.0)) is None
    # Traffic ended inside the interval: nothing runs now, but tokens moved -> one last line.
    assert is_busy(sample(10.0), sample(20.0, streamed=5, finished=1))
    # Then idle again: the counters did not move and nothing runs or waits.
    assert not is_busy(sample(20.0, streamed=5, finished=1), sample(30.0, streamed=5, finished=1))


def test_busy_when_only_running_or_waiting_requests_or_prefills_moved() -> None:
    waiting = {"d0": WorkerSample("decode", WorkerLoad(0, 1, 100, 100), 0, 0)}
    assert is_busy(sample(0.0), sample(10.0, workers=waiting))
    assert is_busy(sample(0.0), sample(10.0, in_flight=1))
    prefilled = {"p0": WorkerSample("prefill", IDLE_LOAD, 64, 0)}
    assert is_busy(sample(0.0, workers=prefilled), sample(10.0, workers=prefilled)) is False
    assert is_busy(sample(0.0), sample(10.0, workers=prefilled))


def test_a_worker_that_joins_counts_from_zero_and_one_that_left_counts_nothing() -> None:
    before = sample(0.0, workers={"p0": WorkerSample("prefill", IDLE_LOAD, 5000, 5000)})
    now = sample(10.0, streamed=1, workers={"p1": WorkerSample("prefill", IDLE_LOAD, 100, 50)})
    line = stats_line(before, now)
    assert line is not None
    assert "prompt 10.0 tok/s" in line and "prefix hits 50%" in line
    assert "decode (0 workers): running 0, waiting 0, KV 0.0%" in line


def test_samples_read_the_routers_real_totals_and_the_workers_stats() -> None:
    metrics = RouterMetrics()
    metrics.observe_streamed(1)  # a first token
    metrics.observe_streamed(4)  # four more
    metrics.observe_finished("stop", 10, 0, 5, 1.0)
    metrics.running.inc()
    stats = PrefillStats(WorkerState.READY, WorkerLoad(1, 0, 10, 20), num_prompt_tokens=10)
    metrics.worker_stats.update("p0", "prefill", stats)
    got = sample_of(1.0, metrics.totals(), metrics.worker_stats.last())
    assert got.router == RouterTotals(num_streamed_tokens=5, num_finished=1, num_in_flight=1)
    assert got.workers == {"p0": WorkerSample("prefill", WorkerLoad(1, 0, 10, 20), 10, 0)}


def test_aggregated_decode_workers_report_the_prompts_they_computed() -> None:
    """--prefill 0: no prefill worker; the decode worker's own prompts make the prompt rate."""
    metrics = RouterMetrics()
    stats = DecodeStats(
        WorkerState.READY,
        WorkerLoad(1, 0, 10, 20),
        num_local_prefills=2,
        num_local_prompt_tokens=300,
        num_local_cached_tokens=100,
    )
    metrics.worker_stats.update("d0", "decode", stats)
    now = sample_of(10.0, metrics.totals(), metrics.worker_stats.last())
    assert now.workers == {"d0": WorkerSample("decode", WorkerLoad(1, 0, 10, 20), 300, 100)}
    before = sample(0.0, workers={"d0": WorkerSample("decode", IDLE_LOAD, 0, 0)})
    line = stats_line(before, now)
    assert line is not None and "prompt 30.0 tok/s" in line
    assert "prefill (0 workers)" in line and "decode (1 worker): running 1" in line
    assert line.endswith("prefix hits 33%")


def test_the_line_shows_the_routers_queue_by_class() -> None:
    """The FairQueue's gauges on the router's registry: queued and running by key class."""
    metrics = RouterMetrics()
    queue = FairQueue(max_running=1, registry=metrics.registry)
    batch = KeyClass(TrafficClass.BATCH)

    async def scenario() -> RouterTotals:
        release = asyncio.Event()

        async def hold(t: Ticket) -> None:
            async with queue.turn(t):
                await release.wait()

        tasks = [
            asyncio.create_task(hold(Ticket(f"b{i}", "t", batch, -1, 10, None))) for i in range(3)
        ]
        while queue.num_queued < 2:
            await asyncio.sleep(0)
        totals = metrics.totals()
        release.set()
        await asyncio.gather(*tasks)
        return totals

    totals = asyncio.run(scenario())
    assert totals.queue == (
        ClassQueue("interactive", 0, 0),
        ClassQueue("batch", queued=2, running=1),
    )
    assert metrics.totals().queue[1] == ClassQueue("batch", 0, 0)  # all ended
    line = stats_line(sample(0.0), StatsSample(10.0, totals, {}))
    assert line is not None
    assert "router queue: interactive 0 queued 0 running, batch 2 queued 1 running" in line
    queued_only = totals._replace(num_in_flight=0)  # busy while requests wait in the queue
    assert is_busy(sample(0.0), StatsSample(10.0, queued_only, {}))
