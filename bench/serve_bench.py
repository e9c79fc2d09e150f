"""Load generator for the kvrelay router: sends a seeded workload (random token prompts, or
groups sharing a long system prefix) over HTTP/SSE or gRPC at a given arrival rate and reports
TTFT, TPOT, ITL and end-to-end latency percentiles, throughput and the prefix hit rate.
Owns no state beyond one run (and, with --launch, the `kvrelay serve` process it starts).

    python -m bench.serve_bench --launch --transport http --num-requests 64 --rate 4
    python -m bench.serve_bench --url http://127.0.0.1:8000 --workload shared-prefix \\
        --num-groups 8 --prefix-len 512 --input-len 32 --output-len 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import signal
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lib.prefix_probe import prefill_holders, redis_url_from_log
from bench.lib.serve_client import (
    BenchRequest,
    Client,
    GrpcClient,
    HttpClient,
    RequestResult,
    Sampling,
    check_loopback,
    grpc_model_id,
    served_model_id,
)
from bench.lib.serve_launch import ROOT, LaunchedServer, machine_info
from bench.lib.serve_stats import format_table, summarize
from bench.lib.serve_workload import (
    arrival_offsets,
    build_requests,
    group_prefixes,
    warmup_requests,
    with_chat_text,
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- running --------------------------------------------------------------------------------
class Progress:
    """Completion counts on stderr, every tenth of the run or every 10 s."""

    def __init__(self, total: int):
        self.total, self.done, self.failed = total, 0, 0
        self.started = self.last = time.monotonic()
        self.step = max(1, total // 10)

    def update(self, result: RequestResult) -> None:
        self.done += 1
        self.failed += not result.ok
        now = time.monotonic()
        if self.done % self.step == 0 or self.done == self.total or now - self.last > 10:
            self.last = now
            log(
                f"  {self.done}/{self.total} done ({self.failed} failed),"
                f" {now - self.started:.1f} s"
            )


async def run_timed(
    client: Client,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    concurrency: int,
    max_duration_s: float,
) -> tuple[list[RequestResult], float, float]:
    """Send each request at its offset (at most `concurrency` in flight when > 0); requests
    not finished within max_duration_s are cancelled and count as failed.
    Returns (results, t0, duration from t0 to the last completion)."""
    semaphore = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    progress = Progress(len(requests))
    t0 = time.perf_counter()

    async def one(request: BenchRequest, offset: float) -> RequestResult:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with semaphore or contextlib.nullcontext():
            result = await client.send(request)
        progress.update(result)
        return result

    tasks = [asyncio.create_task(one(r, o)) for r, o in zip(requests, offsets, strict=True)]
    try:
        done, pending = await asyncio.wait(tasks, timeout=max_duration_s)
    finally:  # past the deadline, or interrupted: no request outlives this call
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    results = []
    for request, task in zip(requests, tasks, strict=True):
        if task in done and task.exception() is None:
            results.append(task.result())
        else:
            error = "unfinished at --max-duration" if task in pending else repr(task.exception())
            results.append(RequestResult(request.index, request.group, error=error))
    ends = [r.start + r.e2e_s for r in results if r.ok]
    return results, t0, (max(ends) - t0) if ends else 0.0


def make_client(args: argparse.Namespace, url: str, target: str, model: str) -> Client:
    sampling = Sampling(args.temperature, not args.no_ignore_eos, args.sampling_seed)
    if args.transport == "grpc":
        return GrpcClient(target, sampling, args.request_timeout)
    return HttpClient(url, model, sampling, args.request_timeout, chat=args.endpoint == "chat")


async def run_bench(
    args: argparse.Namespace, requests: list[BenchRequest], url: str, target: str
) -> dict[str, Any]:
    model = args.model
    if not model:
        model = await (served_model_id(url) if args.transport == "http" else grpc_model_id(target))
    client = make_client(args, url, target, model)
    try:
        warmups = warmup_requests(args)
        if args.endpoint == "chat":
            warmups = with_chat_text(warmups, args.tokenizer)
        for request in warmups:
            result = await client.send(request)
            if not result.ok:
                raise RuntimeError(f"warmup request failed: {result.error}")
        log(f"warmup: {len(warmups)} request(s) done; sending {len(requests)} requests")
        offsets = arrival_offsets(args)
        results, t0, duration = await run_timed(
            client, requests, offsets, args.concurrency, args.max_duration
        )
    finally:
        await client.close()
    return {
        "model": model,
        "summary": summarize(results, duration),
        "requests": [request_record(r, t0) for r in results],
    }


def request_record(r: RequestResult, t0: float) -> dict[str, Any]:
    return {
        "index": r.index,
        "group": r.group,
        "ok": r.ok,
        "error": r.error,
        "send_s": r.start - t0 if r.start else None,
        "ttft_s": r.ttft_s,
        "tpot_s": r.tpot_s,
        "e2e_s": r.e2e_s,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "output_tokens": r.output_tokens,
        "num_chunks": len(r.token_times),
        "finish_reason": r.finish_reason,
    }


# ---- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("target")
    g.add_argument("--transport", choices=["http", "grpc"], default="http")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="HTTP base URL (loopback)")
    g.add_argument("--target", default="127.0.0.1:50051", help="gRPC host:port (loopback)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--model", default=None, help="model id (default: the first /v1/models)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json for --endpoint chat")
    g = p.add_argument_group("launch")
    g.add_argument("--launch", action="store_true", help="start `kvrelay serve` for this run")
    g.add_argument("--prefill", type=int, default=1)
    g.add_argument("--decode", type=int, default=1)
    g.add_argument("--policy", choices=["kv_aware", "round_robin", "random"], default="kv_aware")
    g.add_argument("--server-args", default="", help="more `serve` flags, one quoted string")
    g.add_argument("--startup-timeout", type=float, default=240.0)
    g.add_argument(
        "--worker-niceness", type=int, default=None, help="RAY_worker_niceness (Ray default: 15)"
    )
    g.add_argument(
        "--server-root", type=Path, default=ROOT, help="kvrelay checkout to serve (a snapshot)"
    )
    g = p.add_argument_group("load")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--rate", type=float, default=float("inf"), help="req/s; inf: all at once")
    g.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    g.add_argument("--concurrency", type=int, default=0, help="max in flight (0: no cap)")
    g.add_argument("--warmup", type=int, default=1, help="untimed requests first")
    g.add_argument("--request-timeout", type=float, default=300.0)
    g.add_argument("--max-duration", type=float, default=600.0, help="cancel what is left then")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=["random", "shared-prefix"], default="random")
    g.add_argument("--input-len", type=int, default=128, help="prompt (or suffix) tokens")
    g.add_argument("--input-len-range", type=float, default=0.0, help="uniform +- ratio")
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--output-len-range", type=float, default=0.0, help="uniform +- ratio")
    g.add_argument("--num-groups", type=int, default=8, help="shared-prefix groups")
    g.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens")
    g.add_argument("--block-size", type=int, default=16, help="the server's (prefix probe)")
    g.add_argument("--redis-url", default=None, help="index to probe without --launch")
    g.add_argument("--min-token-id", type=int, default=100)
    g.add_argument("--max-token-id", type=int, default=20000, help="exclusive")
    g.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    g = p.add_argument_group("output")
    g.add_argument("--json", type=Path, default=None, help="write summary + per-request data")
    g.add_argument("--label", default="", help="a name for this run in the table and JSON")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.num_requests < 1 or args.rate <= 0:
        raise ValueError("--num-requests must be >= 1 and --rate > 0")
    if args.workload == "shared-prefix" and (args.num_groups < 1 or args.prefix_len < 1):
        raise ValueError("shared-prefix needs --num-groups >= 1 and --prefix-len >= 1")
    if not 0 <= args.min_token_id < args.max_token_id:
        raise ValueError("need 0 <= --min-token-id < --max-token-id")
    if args.transport == "grpc" and args.endpoint == "chat":
        raise ValueError("--endpoint chat is HTTP only")
    if not args.launch:
        from urllib.parse import urlsplit

        check_loopback(urlsplit(args.url).hostname or "")
        check_loopback(args.target.rsplit(":", 1)[0].strip("[]"))


def run(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    """The benchmark against --url/--target, or against a server launched for it."""
    if not args.launch:
        report = asyncio.run(run_bench(args, requests, args.url, args.target))
        report["prefix_index"] = probe_prefixes(args, report, args.redis_url)
        return report
    extra = shlex.split(args.server_args)
    server = LaunchedServer(
        args.prefill,
        args.decode,
        args.policy,
        extra,
        args.startup_timeout,
        worker_niceness=args.worker_niceness,
        server_root=args.server_root,
    )
    with server:
        report = asyncio.run(run_bench(args, requests, server.http_url, server.grpc_target))
        report["server"] = {"command": server.describe(), "startup_s": server.startup_s}
        redis_url = redis_url_from_log(server.log_path.read_text(errors="replace"))
        report["prefix_index"] = probe_prefixes(args, report, redis_url)
    return report


def probe_prefixes(
    args: argparse.Namespace, report: dict[str, Any], redis_url: str | None
) -> dict[str, Any] | None:
    """shared-prefix: prefill-side prefix copies from the Redis index, and the prefill hit
    rate they allow at most (every group prefix computed once per holder, no eviction)."""
    if args.workload != "shared-prefix" or not redis_url:
        return None
    try:
        probe = prefill_holders(redis_url, report["model"], group_prefixes(args), args.block_size)
    except Exception as e:  # the index is a cross-check, not the benchmark
        log(f"prefix index probe failed: {e}")
        return None
    summary = report["summary"]
    computed = sum(probe["prefill_copies_per_group"]) * probe["prefix_tokens_indexed"]
    reusable = summary["completed"] * probe["prefix_tokens_indexed"] - computed
    prompt = summary["total_prompt_tokens"]
    probe["prefill_hit_rate_upper_bound"] = max(0, reusable) / prompt if prompt else 0.0
    return probe


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        log(f"error: {e}")
        return 2
    # Ctrl-C and SIGTERM stop the run (and a launched server), even when started in the
    # background with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    requests = build_requests(args)
    if args.endpoint == "chat":
        requests = with_chat_text(requests, args.tokenizer)
    report: dict[str, Any] = {
        "label": args.label,
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join(["python", sys.argv[0], *(argv or sys.argv[1:])]),
        "config": {
            k: v if isinstance(v, int | str | None) else str(v) for k, v in vars(args).items()
        },
        "machine": machine_info(),
    }
    try:
        report.update(run(args, requests))
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    report["machine_after"] = {"loadavg_1_5_15": machine_info()["loadavg_1_5_15"]}
    title = f"serve_bench {args.label or ''} [{args.transport}, {args.workload}]".replace("  ", " ")
    print(format_table(report["summary"], title))
    if probe := report.get("prefix_index"):
        print(
            f"prefix index: prefill copies per group {probe['prefill_copies_per_group']}"
            f" (mean {probe['mean_prefill_copies']:.2f}); prefill hit rate <="
            f" {probe['prefill_hit_rate_upper_bound']:.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0 if report["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
