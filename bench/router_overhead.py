"""Router added latency: p50 TTFT and end-to-end latency of short requests sent one at a time
through the whole cluster (router over HTTP and gRPC, prefill worker, KV transfer, decode
worker) vs the same kind of prompts given straight to an `engine.engine.Engine` (default
config, timed from add_request to the first token and to the finish). Also reads the router's
/metrics for its own view (router TTFT, queue time, KV transfer time). Owns no state beyond one
run: the direct engine (bench/lib/direct_engine.py) lives in a child process started and
stopped here, at the niceness and thread count of the cluster's workers, so both sides meet
other jobs on a shared CPU alike; the paths are interleaved (round i: one direct request, then
one per transport).

    python -m bench.router_overhead --launch [--num-requests 30 --input-len 32 --output-len 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from bench.lib.direct_engine import DirectEngine, Timing
from bench.lib.serve_client import (
    BenchRequest,
    Client,
    GrpcClient,
    HttpClient,
    Sampling,
    check_loopback,
    served_model_id,
)
from bench.lib.serve_launch import (
    ROOT,
    LaunchedServer,
    command_line,
    interrupt_on_signal,
    machine_info,
)

# Router histograms (sum, count) read from /metrics around each measured window.
ROUTER_METRICS = {
    "router_ttft": "kvrelay_time_to_first_token_seconds",
    "router_queue": "kvrelay_queue_time_seconds",
    "router_e2e": "kvrelay_request_latency_seconds",
    "kv_transfer": "kvrelay_kv_transfer_seconds",
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def path_prompts(args: argparse.Namespace, path: str) -> list[tuple[int, ...]]:
    """Warmup + measured prompts for one path, distinct across paths (no cross-path hits)."""
    rng = random.Random(f"{args.seed}/{path}")
    num = args.warmup + args.num_requests
    return [tuple(rng.randrange(100, 20000) for _ in range(args.input_len)) for _ in range(num)]


# ---- through the cluster --------------------------------------------------------------------
async def scrape(url: str) -> dict[str, float]:
    """Unlabelled `name value` samples of the router's /metrics."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(f"{url.rstrip('/')}/metrics") as resp,
    ):
        text = await resp.text()
    samples = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            samples[parts[0]] = float(parts[1])
    return samples


def metric_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    means: dict[str, float | None] = {}
    for key, name in ROUTER_METRICS.items():
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        means[key] = 1000.0 * total / count if count > 0 else None
    return means


async def _cluster_one(client: Client, i: int, prompt: tuple[int, ...], output_len: int) -> Timing:
    result = await client.send(BenchRequest(i, prompt, output_len))
    if not result.ok or result.ttft_s is None:
        raise RuntimeError(f"request {i} failed: {result.error}")
    return Timing(result.ttft_s, result.e2e_s, result.output_tokens)


async def run_interleaved(
    args: argparse.Namespace, direct: DirectEngine, url: str, target: str
) -> tuple[dict[str, list[Timing]], dict[str, float | None]]:
    """Round i sends prompt i of each path in turn (engine direct, then each transport), so
    drifting background load hits every path alike. Fresh prompts per path: no cache hits.
    Returns the measured Timings per path and the router's /metrics means over them."""
    model = await served_model_id(url)
    sampling = Sampling(temperature=0.0, ignore_eos=True)
    clients: dict[str, Client] = {}
    for transport in args.transports:
        if transport == "grpc":
            clients[transport] = GrpcClient(target, sampling, args.request_timeout)
        else:
            clients[transport] = HttpClient(url, model, sampling, args.request_timeout)
    paths = ["direct", *clients]
    prompts = {path: path_prompts(args, path) for path in paths}
    timings: dict[str, list[Timing]] = {path: [] for path in paths}
    before: dict[str, float] = {}
    try:
        for i in range(args.warmup + args.num_requests):
            if i == args.warmup:
                before = await scrape(url)
            for path in paths:
                if path == "direct":
                    timing = await direct.run(f"direct-{i}", prompts[path][i])
                else:
                    timing = await _cluster_one(clients[path], i, prompts[path][i], args.output_len)
                if i >= args.warmup:
                    timings[path].append(timing)
            if (i + 1) % 10 == 0:
                log(f"  round {i + 1}/{args.warmup + args.num_requests}")
        after = await scrape(url)
    finally:
        for client in clients.values():
            await client.close()
    return timings, metric_means_ms(before, after)


# ---- report ---------------------------------------------------------------------------------
def stats_ms(timings: Sequence[Timing], direct: Sequence[Timing]) -> dict[str, float]:
    """p50s and means; paired_*: the median over rounds of (this path - engine direct)."""
    ttft = np.asarray([t.ttft_s for t in timings]) * 1000.0
    e2e = np.asarray([t.e2e_s for t in timings]) * 1000.0
    direct_ttft = np.asarray([t.ttft_s for t in direct]) * 1000.0
    direct_e2e = np.asarray([t.e2e_s for t in direct]) * 1000.0
    return {
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_mean": float(ttft.mean()),
        "e2e_p50": float(np.percentile(e2e, 50)),
        "e2e_mean": float(e2e.mean()),
        "paired_added_ttft_p50": float(np.median(ttft - direct_ttft)),
        "paired_added_e2e_p50": float(np.median(e2e - direct_e2e)),
        "num_requests": len(timings),
        "output_tokens_per_request": float(np.mean([t.num_tokens for t in timings])),
    }


def format_report(paths: dict[str, dict[str, float]], router: dict[str, float | None]) -> str:
    direct = paths["engine direct"]
    header = (
        f"{'path':<18}{'TTFT p50':>10}{'e2e p50':>10}{'+TTFT':>9}{'+e2e':>9}"
        f"{'paired +TTFT':>14}{'paired +e2e':>13}"
    )
    lines = [header, "-" * len(header)]
    for name, s in paths.items():
        lines.append(
            f"{name:<18}{s['ttft_p50']:>10.1f}{s['e2e_p50']:>10.1f}"
            f"{s['ttft_p50'] - direct['ttft_p50']:>+9.1f}{s['e2e_p50'] - direct['e2e_p50']:>+9.1f}"
            f"{s['paired_added_ttft_p50']:>+14.1f}{s['paired_added_e2e_p50']:>+13.1f}"
        )
    lines.append(
        "(ms; +X = p50 of the path - p50 of engine direct;"
        " paired +X = median over rounds of the per-round difference)"
    )
    cells = ", ".join(f"{k} {v:.1f}" for k, v in router.items() if v is not None)
    lines.append(f"router /metrics means over the cluster requests (ms): {cells}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--launch", action="store_true", help="start `kvrelay serve` (1P + 1D)")
    p.add_argument("--server-args", default="", help="more `serve` flags, one quoted string")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--target", default="127.0.0.1:50051")
    p.add_argument("--transports", default="http,grpc", type=lambda s: s.split(","))
    p.add_argument("--num-requests", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads of the direct engine (default: what each cluster worker gets)",
    )
    p.add_argument(
        "--worker-niceness", type=int, default=None, help="RAY_worker_niceness (Ray default: 15)"
    )
    p.add_argument(
        "--server-root",
        type=Path,
        default=ROOT,
        help="kvrelay checkout for the cluster and the direct engine (e.g. a snapshot)",
    )
    p.add_argument(
        "--direct-nice",
        type=int,
        default=None,
        help="niceness of the direct engine (default: --worker-niceness, else Ray's 15)",
    )
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--json", type=Path, default=None)
    return p


def measure(args: argparse.Namespace) -> tuple[dict[str, list[Timing]], dict[str, Any]]:
    """Start the direct engine (and, with --launch, the cluster), run the rounds, stop both."""
    nice = args.direct_nice
    if nice is None:
        nice = 15 if args.worker_niceness is None else args.worker_niceness
    log(f"engine direct: child process, {args.threads} torch thread(s), nice {nice}")
    direct = DirectEngine(
        args.threads, nice, args.output_len, args.request_timeout, args.server_root
    )
    try:
        if not args.launch:
            check_loopback(urlsplit(args.url).hostname or "")
            direct.wait_ready()
            timings, router = asyncio.run(run_interleaved(args, direct, args.url, args.target))
            return timings, {"router_metrics_means_ms": router}
        server = LaunchedServer(
            1,
            1,
            "kv_aware",
            shlex.split(args.server_args),
            worker_niceness=args.worker_niceness,
            server_root=args.server_root,
        )
        with server:
            direct.wait_ready()
            run = run_interleaved(args, direct, server.http_url, server.grpc_target)
            timings, router = asyncio.run(run)
            command = server.describe()
        return timings, {"router_metrics_means_ms": router, "server_command": command}
    finally:
        direct.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if bad := set(args.transports) - {"http", "grpc"}:
        log(f"error: unknown transports {sorted(bad)}")
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt_on_signal)
    machine = machine_info()
    try:
        timings, extra = measure(args)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    names = {"direct": "engine direct", "http": "cluster via HTTP", "grpc": "cluster via gRPC"}
    paths = {names[path]: stats_ms(t, timings["direct"]) for path, t in timings.items()}
    print(format_report(paths, extra["router_metrics_means_ms"]))
    if args.json:
        report = {
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "command": command_line("bench.router_overhead", argv),
            "machine": machine,
            "loadavg_after": machine_info()["loadavg_1_5_15"],
            "paths_ms": paths,
            **extra,
            "rounds_ms": {
                names[path]: [[1000 * t.ttft_s, 1000 * t.e2e_s] for t in ts]
                for path, ts in timings.items()
            },
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
