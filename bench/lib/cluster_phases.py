"""gpu_cluster_bench's two phases on the same planned runs: the cluster (`kvrelay serve`, 1
prefill + 1 decode worker, loaded over gRPC) and the aggregated engines (one Engine per GPU,
driven in-process). Each fills its report section and owns, for its length, the server or the
engine processes it starts and stops.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.lib.aggregated_engines import AggregatedEngines, EngineSpec
from bench.lib.cluster_plan import (
    ENGINES_CLOSE_RESERVE_S,
    STOP_RESERVE_S,
    Deadline,
    PlannedRun,
    log,
    run_budget,
    run_record,
    startup_time_left,
    summarize_from_zero,
    torch_threads_per_engine,
)
from bench.lib.engine_config import engine_config, gib
from bench.lib.open_loop import TimedRequest, trace_extras, trace_result
from bench.lib.serve_client import RequestResult
from bench.lib.serve_launch import LaunchedServer
from bench.lib.serve_run import request_record, run_bench
from bench.lib.serve_workload import arrival_offsets, build_requests, warmup_requests


# ---- the cluster ----------------------------------------------------------------------------
def server_flags(args: argparse.Namespace, model_folder: Path) -> list[str]:
    flags = [
        *("--model", str(model_folder), "--load-format", "dummy"),
        *("--device", args.device, "--dtype", args.dtype),
        *("--kv-cache-gib", str(args.kv_cache_gib), "--block-size", str(args.block_size)),
        *("--max-num-seqs", str(args.max_num_seqs)),
        *("--max-num-batched-tokens", str(args.max_num_batched_tokens)),
        *("--max-model-len", str(args.max_model_len)),
        *("--threads-per-worker", str(torch_threads_per_engine(2))),
    ]
    if args.no_redis or shutil.which("redis-server") is None:
        flags.append("--no-redis")
    return [*flags, *shlex.split(args.server_args)]


def run_cluster(
    args: argparse.Namespace,
    model_folder: Path,
    runs: Sequence[PlannedRun],
    deadline: Deadline,
    section: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Fill section (already in the report that save() writes) with the cluster's runs."""
    section["setup"] = "kvrelay serve, 1 prefill + 1 decode worker (one GPU each), load over gRPC"
    section["runs"] = []
    startup_timeout = startup_time_left(args, deadline, STOP_RESERVE_S, runs, "cluster", section)
    if startup_timeout is None:
        return
    flags = server_flags(args, model_folder)
    if "--no-redis" in flags:
        section["note"] = "run with --no-redis (one prefill worker: placement is the same)"
    server = LaunchedServer(
        1,
        1,
        "kv_aware",
        flags,
        startup_timeout,
        stop_timeout_s=30.0,
        worker_niceness=args.worker_niceness,
        log=log,
    )
    section["server"] = {"command": server.describe()}
    try:
        with server:
            section["server"]["startup_s"] = server.startup_s
            save()
            for run in runs:
                section["runs"].append(cluster_run(run, server, deadline, args.drain_s))
                save()
    except Exception as e:  # recorded; the aggregated phase still runs
        log(f"cluster: failed: {type(e).__name__}: {e}")
        section["error"] = f"{type(e).__name__}: {e}"
    finally:
        section["server_log"] = keep_server_log(server.log_path, args.json)


def cluster_run(
    run: PlannedRun, server: LaunchedServer, deadline: Deadline, drain_s: float
) -> dict[str, Any]:
    max_duration = run_budget(run, deadline, STOP_RESERVE_S, drain_s)
    if max_duration <= 0:
        log(f"cluster {run.label}: skipped (time budget)")
        return {"label": run.label, "rate": run.rate, "skipped": "time budget"}
    workload = argparse.Namespace(**vars(run.workload))
    workload.max_duration = workload.request_timeout = max_duration
    log(f"cluster {run.label}: {workload.num_requests} requests at {run.rate:g} req/s")
    requests = build_requests(workload)
    report = asyncio.run(run_bench(workload, requests, server.http_url, server.grpc_target)).report
    summary = report["summary"]
    log(f"cluster {run.label}: {summary['completed']} ok in {summary['duration_s']:.1f} s")
    return run_record(run, max_duration, summary, report["requests"])


def keep_server_log(log_path: Path, json_path: Path | None) -> str:
    """Copy the server's log next to --json (it comes back with the results)."""
    if json_path is None or not log_path.is_file():
        return str(log_path)
    target = json_path.with_suffix(".server.log")
    shutil.copyfile(log_path, target)
    return str(target)


# ---- the aggregated engines -----------------------------------------------------------------
def run_aggregated(
    args: argparse.Namespace,
    model_folder: Path,
    runs: Sequence[PlannedRun],
    deadline: Deadline,
    section: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Fill section (already in the report that save() writes) with the engines' runs."""
    gpu_ids = engine_gpu_ids(args)
    section["setup"] = (
        f"{len(gpu_ids)} engine.engine.Engine, one per GPU, each prefill + decode;"
        " in-process open-loop driver (no router, HTTP, gRPC or KV transfer in the path)"
    )
    section["runs"] = []
    startup_timeout = startup_time_left(
        args, deadline, ENGINES_CLOSE_RESERVE_S, runs, "aggregated", section
    )
    if startup_timeout is None:
        return
    config = engine_config(
        str(model_folder),
        device=args.device,
        dtype=args.dtype,
        load_format="dummy",
        block_size=args.block_size,
        kv_cache_memory_bytes=gib(args.kv_cache_gib),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )
    spec = EngineSpec(config, torch_threads_per_engine(len(gpu_ids)))
    section["engine_spec"] = asdict(spec)
    warmups = [r.prompt_ids for r in warmup_requests(runs[0].workload)]
    log(f"aggregated: starting {len(gpu_ids)} engines on CUDA_VISIBLE_DEVICES {gpu_ids}")
    try:
        with AggregatedEngines(spec, gpu_ids, warmups) as engines:
            section["engines"] = engines.wait_ready(startup_timeout)
            log("aggregated: engines built and warmed up")
            save()
            for run in runs:
                section["runs"].append(aggregated_run(run, engines, deadline, args.drain_s))
                save()
    except Exception as e:  # recorded with what ran before it
        log(f"aggregated: failed: {type(e).__name__}: {e}")
        section["error"] = f"{type(e).__name__}: {e}"


def engine_gpu_ids(args: argparse.Namespace) -> list[str | None]:
    ids = [g.strip() for g in args.gpus.split(",") if g.strip()]
    return [g if args.device.startswith("cuda") else None for g in ids]


def aggregated_run(
    run: PlannedRun, engines: AggregatedEngines, deadline: Deadline, drain_s: float
) -> dict[str, Any]:
    max_duration = run_budget(run, deadline, ENGINES_CLOSE_RESERVE_S, drain_s)
    if max_duration <= 0:
        log(f"aggregated {run.label}: skipped (time budget)")
        return {"label": run.label, "rate": run.rate, "skipped": "time budget"}
    requests = build_requests(run.workload)
    offsets = arrival_offsets(run.workload)
    timed = [
        TimedRequest(r.index, r.prompt_ids, r.max_tokens, offset)
        for r, offset in zip(requests, offsets, strict=True)
    ]
    num_engines = len(engines.conns)
    shares = [timed[i::num_engines] for i in range(num_engines)]  # round-robin
    log(f"aggregated {run.label}: {len(timed)} requests at {run.rate:g} req/s")
    traces_per_engine = engines.run(run.label, shares, max_duration)
    expected = {r.index: r.max_tokens for r in requests}
    per_engine: list[list[RequestResult]] = []
    records = []
    for engine_index, traces in enumerate(traces_per_engine):
        per_engine.append([trace_result(t, expected[t.index]) for t in traces])
        records += [
            request_record(result, 0.0) | trace_extras(trace, engine_index)
            for result, trace in zip(per_engine[-1], traces, strict=True)
        ]
    records.sort(key=lambda r: r["index"])
    all_results = sorted((r for results in per_engine for r in results), key=lambda r: r.index)
    summary = summarize_from_zero(all_results)
    log(f"aggregated {run.label}: {summary['completed']} ok in {summary['duration_s']:.1f} s")
    record = run_record(run, max_duration, summary, records)
    record["per_engine"] = [summarize_from_zero(results) for results in per_engine]
    return record
