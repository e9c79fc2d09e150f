"""serve_bench's command line (also how gpu_cluster_bench describes its workloads), the checks
on it and its split into one run per --rate; stateless.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from urllib.parse import urlsplit

from bench.lib.serve_client import check_loopback
from bench.lib.serve_launch import ROOT


def build_parser(description: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
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
    g.add_argument(
        "--rate",
        dest="rates",
        metavar="RATE",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="req/s, one run each (one server for all with --launch); inf: all at once",
    )
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
    g.add_argument(
        "--seed", type=int, default=0, help="workload and arrival seed (run k of --rate: seed + k)"
    )
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    g = p.add_argument_group("output")
    g.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write summary + per-request data, and PNG plots beside it (NAME.*.png)",
    )
    g.add_argument("--label", default="", help="a name for this run in the table and JSON")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.num_requests < 1 or min(args.rates) <= 0:
        raise ValueError("--num-requests must be >= 1 and --rate > 0")
    if args.workload == "shared-prefix" and (args.num_groups < 1 or args.prefix_len < 1):
        raise ValueError("shared-prefix needs --num-groups >= 1 and --prefix-len >= 1")
    if not 0 <= args.min_token_id < args.max_token_id:
        raise ValueError("need 0 <= --min-token-id < --max-token-id")
    if args.transport == "grpc" and args.endpoint == "chat":
        raise ValueError("--endpoint chat is HTTP only")
    if not args.launch:
        check_loopback(urlsplit(args.url).hostname or "")
        check_loopback(args.target.rsplit(":", 1)[0].strip("[]"))


def rate_runs(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One copy of args per --rate, with that `rate`; run k uses seed + k, so the runs of one
    server share no prompts (no prefix cache hits from an earlier run)."""
    runs = []
    for k, rate in enumerate(args.rates):
        run = copy.copy(args)
        run.rate, run.seed = rate, args.seed + k
        runs.append(run)
    return runs
