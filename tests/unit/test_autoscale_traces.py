"""The autoscaler (deploy/autoscale.py) replaying stored per-second load traces (synthetic shapes,
tests/unit/data/autoscale_traces.json) through the simulated pool of test_autoscale: a queue
ramp grows the pool, its drain shrinks it after the cooldown, a load on the line between sizes
1 and 2 makes one decision in 15 minutes, and a cold worker's first samples scale nothing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from deploy.autoscale import AutoscaleConfig
from tests.unit.test_autoscale import CONFIG, Attainment, simulate

TRACES: dict[str, Any] = json.loads(
    (Path(__file__).parent / "data" / "autoscale_traces.json").read_text()
)


def replay(
    name: str,
    config: AutoscaleConfig = CONFIG,
    start: int | None = None,
    attainment: Attainment | None = None,
) -> list[tuple[float, int]]:
    trace = TRACES[name]
    load: list[int] = trace["load"]
    return simulate(
        trace["role"],
        lambda t: load[int(t)],
        len(load),
        trace["start_size"] if start is None else start,
        config,
        attainment,
        trace.get("ready_at"),
    )


def test_a_queue_ramp_grows_the_pool_and_its_drain_shrinks_it_after_the_cooldown() -> None:
    load = TRACES["queue_ramp"]["load"]
    decisions = replay("queue_ramp")
    assert decisions == [(39.0, 2), (62.0, 3), (167.0, 2), (187.0, 1)]
    sizes = [1] + [size for _, size in decisions]
    peak = sizes.index(max(sizes))
    assert sizes[: peak + 1] == sorted(sizes[: peak + 1]), "up, then"
    assert sizes[peak:] == sorted(sizes[peak:], reverse=True), "down: never up again"
    n = 1
    for (at, size), (before, _) in zip(decisions, [(-100.0, 1), *decisions], strict=False):
        assert at - before >= CONFIG.cooldown_s
        window = load[int(at - CONFIG.window_s) : int(at) + 1]
        per_worker = CONFIG.target_queued_tokens
        if size > n:  # the whole window over the grow line
            assert min(window) > n * per_worker
        else:  # the whole window under the shrink line even with one worker fewer
            assert max(window) < CONFIG.shrink_below * size * per_worker
        n = size


def test_load_on_the_line_between_one_and_two_workers_does_not_oscillate() -> None:
    # 5..13 running requests for 15 minutes, 8 per worker: one grow, then it holds.
    assert replay("boundary") == [(11.0, 2)]
    assert replay("boundary", start=2) == []
    # The same trace does cross the line both ways: with almost no band between the grow
    # and shrink lines the pool flips every minute or so.
    narrow = dataclasses.replace(CONFIG, shrink_below=0.95)
    assert len(replay("boundary", narrow)) >= 10


def test_a_cold_workers_first_samples_scale_nothing() -> None:
    # 8000 queued tokens (8x the target) for the first 14 s after the worker turned ready.
    assert replay("cold_start", dataclasses.replace(CONFIG, warmup_s=15.0)) == []
    # Counted as real load, the same samples would have grown the pool (and shrunk it back).
    assert replay("cold_start", dataclasses.replace(CONFIG, warmup_s=0.0)) == [(10.0, 2), (30.0, 1)]


def test_slo_misses_on_the_ramp_grow_the_pool_before_its_queue_does() -> None:
    load = TRACES["queue_ramp"]["load"]

    def ttft_misses(now: float, n: int) -> float:
        return 0.5 if load[int(now)] / n > 700 else 0.99  # queue waits past the TTFT objective

    decisions = replay("queue_ramp", attainment=ttft_misses)
    assert decisions == [(36.0, 2), (59.0, 3), (167.0, 2), (187.0, 1)]
    assert decisions[0][0] < replay("queue_ramp")[0][0]
