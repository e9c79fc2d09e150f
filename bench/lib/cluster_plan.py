"""gpu_cluster_bench's plan and clock: one run per --rate (serve_bench's seeded workloads), the
time budget every phase is cut to, and each run's record. Owns the script's start time (this
module's import) and its stamped log; no other state.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from bench.lib.serve_args import build_parser as serve_bench_parser
from bench.lib.serve_args import check_args, rate_runs
from bench.lib.serve_client import RequestResult
from bench.lib.serve_stats import summarize
from bench.lib.serve_workload import arrival_offsets

STARTED = time.monotonic()
MIN_DRAIN_S = 20.0  # a run is skipped unless its arrivals plus this much fit in the budget
STOP_RESERVE_S = 45.0  # stopping the server (Ray workers, redis-server)
ENGINES_STARTUP_RESERVE_S = 90.0  # spawn, import torch, build, capture graphs, warm up
ENGINES_CLOSE_RESERVE_S = 15.0


def log(message: str) -> None:
    stamp = datetime.now(UTC).strftime("%H:%M:%S")
    print(f"[{stamp} +{time.monotonic() - STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PlannedRun:
    """One measured run: its rate and the serve_bench arguments (seeded workload) it uses."""

    label: str
    rate: float
    workload: argparse.Namespace

    @property
    def last_arrival_s(self) -> float:
        return arrival_offsets(self.workload)[-1]

    @property
    def min_time_s(self) -> float:
        return self.last_arrival_s + MIN_DRAIN_S


def plan_runs(args: argparse.Namespace) -> list[PlannedRun]:
    """One run per --rate, as serve_bench splits them (run k uses seed --seed + k: fresh
    prompts, no prefix hits across runs). The cluster and the aggregated engines get exactly
    the same requests per run."""
    argv = [
        *("--transport", "grpc", "--workload", "random", "--arrival", "poisson"),
        *("--num-requests", str(args.num_requests), "--rate", *map(str, args.rate)),
        *("--input-len", str(args.input_len), "--output-len", str(args.output_len)),
        *("--seed", str(args.seed), "--warmup", str(args.warmup), "--temperature", "0"),
        *("--block-size", str(args.block_size), "--max-token-id", str(args.max_token_id)),
    ]
    workloads = serve_bench_parser().parse_args(argv)
    check_args(workloads)
    return [PlannedRun(f"rate{w.rate:g}-seed{w.seed}", w.rate, w) for w in rate_runs(workloads)]


class Deadline:
    def __init__(self, at_monotonic: float):
        self.at = at_monotonic

    def left(self) -> float:
        return self.at - time.monotonic()


def run_budget(run: PlannedRun, deadline: Deadline, reserve_s: float, drain_s: float) -> float:
    """max_duration for the run (arrivals + drain, capped by the deadline); 0: skip it."""
    available = deadline.left() - reserve_s
    if available < run.min_time_s:
        return 0.0
    return min(run.last_arrival_s + drain_s, available)


def startup_time_left(
    args: argparse.Namespace,
    deadline: Deadline,
    reserve_s: float,
    runs: Sequence[Any],
    name: str,
    section: dict[str, Any],
) -> float | None:
    """Seconds a setup may take to start, leaving its first run and `reserve_s`; None (and the
    section marked skipped) when under 30 s are left."""
    timeout = min(args.startup_timeout, deadline.left() - reserve_s - runs[0].min_time_s)
    if timeout < 30:
        log(f"{name}: skipped (time budget)")
        section["error"] = "skipped: not enough time left in --time-budget"
        return None
    return timeout


def run_record(
    run: PlannedRun, max_duration: float, summary: dict[str, Any], requests: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "label": run.label,
        "rate": run.rate,
        "seed": run.workload.seed,
        "num_requests": run.workload.num_requests,
        "last_arrival_s": run.last_arrival_s,
        "max_duration_s": max_duration,
        "summary": summary,
        "requests": requests,
    }


def summarize_from_zero(results: Sequence[RequestResult]) -> dict[str, Any]:
    """serve_stats.summarize with serve_bench's duration: the shared start (0) to the last
    completion."""
    ends = [r.start + r.e2e_s for r in results if r.ok]
    return summarize(results, max(ends) if ends else 0.0)


def torch_threads_per_engine(num_engines: int) -> int:
    return max(1, (os.cpu_count() or 2) // num_engines)
