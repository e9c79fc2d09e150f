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
import json
import shlex
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from bench.lib.prefix_probe import prefill_holders, redis_url_from_log
from bench.lib.serve_args import build_parser, check_args
from bench.lib.serve_client import BenchRequest
from bench.lib.serve_launch import LaunchedServer, machine_info
from bench.lib.serve_run import run_bench
from bench.lib.serve_stats import format_table
from bench.lib.serve_workload import build_requests, group_prefixes, with_chat_text


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    args = build_parser(__doc__).parse_args(argv)
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
