"""serve_bench's command line, the checks on it and its split into one run per --rate;
stateless.
"""

from __future__ import annotations

import argparse
import copy
import math
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
    g.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="HTTP base URL (loopback); several, comma-separated: each conversation goes to one",
    )
    g.add_argument(
        "--target",
        default="127.0.0.1:50051",
        help="gRPC host:port (loopback); several, comma-separated, as --url",
    )
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--model", default=None, help="model id (default: the first /v1/models)")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="the served model's tokenizer.json, for --endpoint chat and HTTP multi-turn\n"
        "(default: the default model's, SmolLM2's)",
    )
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
    g.add_argument("--num-requests", type=int, default=64, help="(not multi-turn)")
    g.add_argument(
        "--rate",
        dest="rates",
        metavar="RATE",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="req/s (multi-turn: conversation starts/s), one run each (one server for all\n"
        "with --launch); inf: all at once",
    )
    g.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    g.add_argument("--concurrency", type=int, default=0, help="max in flight (0: no cap)")
    g.add_argument("--warmup", type=int, default=1, help="untimed requests first")
    g.add_argument("--request-timeout", type=float, default=300.0)
    g.add_argument("--max-duration", type=float, default=600.0, help="cancel what is left then")
    g = p.add_argument_group("workload")
    g.add_argument(
        "--workload",
        choices=["random", "shared-prefix", "sharegpt", "multi-turn"],
        default="random",
        help="random: --input-len ids; shared-prefix: a group's --prefix-len system prompt +\n"
        "--input-len; sharegpt: ShareGPT-like lognormal lengths (bench/lib/serve_workload.py);\n"
        "multi-turn: conversations whose every turn resends the history (over HTTP the\n"
        "previous output's text re-tokenized with --tokenizer)",
    )
    g.add_argument(
        "--input-len", type=int, default=128, help="prompt (suffix; multi-turn: turn 0) tokens"
    )
    g.add_argument("--input-len-range", type=float, default=0.0, help="uniform +- ratio")
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--output-len-range", type=float, default=0.0, help="uniform +- ratio")
    g.add_argument("--num-groups", type=int, default=8, help="shared-prefix groups")
    g.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens")
    g.add_argument("--max-input-len", type=int, default=2048, help="sharegpt: clip prompts")
    g.add_argument("--max-output-len", type=int, default=1024, help="sharegpt: clip outputs")
    g.add_argument("--num-conversations", type=int, default=8, help="multi-turn")
    g.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    g.add_argument(
        "--turn-input-len", type=int, default=32, help="multi-turn: new user tokens per turn"
    )
    g.add_argument(
        "--think-time-s", type=float, default=0.0, help="multi-turn: pause between turns"
    )
    g.add_argument("--block-size", type=int, default=16, help="the server's (prefix probe)")
    g.add_argument("--redis-url", default=None, help="index to probe without --launch")
    g.add_argument("--min-token-id", type=int, default=100)
    g.add_argument("--max-token-id", type=int, default=20000, help="exclusive")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="workload and arrival seed (a rate's run: seed + 1000 x its rate; inf: seed)",
    )
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    g = p.add_argument_group("goodput")
    g.add_argument(
        "--slo-ttft-ms", type=float, default=2000.0, help="good: TTFT <= this (default 2000)"
    )
    g.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=100.0,
        help="and TPOT <= this (default 100; one-token outputs: TTFT only)",
    )
    g = p.add_argument_group("mix (bench/lib/mixed_load.py)")
    g.add_argument(
        "--mix",
        action="store_true",
        help="with --launch: the workload at --rate from an interactive API key beside a\n"
        "flood of --mix-batch-requests sent at once from a batch key, run twice on one server\n"
        "(--max-running-requests --mix-max-running): the batch key of class batch\n"
        "(priorities), then of no class (none); reports interactive goodput, batch throughput",
    )
    g.add_argument("--mix-batch-requests", type=int, default=32)
    g.add_argument("--mix-batch-output-len", type=int, default=64)
    g.add_argument("--mix-max-running", type=int, default=4)
    g = p.add_argument_group("output")
    g.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write summary + per-request data, and PNG plots beside it (NAME.*.png)",
    )
    g.add_argument("--label", default="", help="a name for this run in the table and JSON")
    g.add_argument(
        "--watch-pools",
        action="store_true",
        help="record the pools' ready workers every second (`kvrelay status`'s view) as\n"
        "pool_sizes in the JSON, plotted; for --server-args '--autoscale-decode 1:4'",
    )
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.num_requests < 1 or min(args.rates) <= 0:
        raise ValueError("--num-requests must be >= 1 and --rate > 0")
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        raise ValueError("--slo-ttft-ms and --slo-tpot-ms must be > 0")
    if args.workload == "sharegpt" and (args.max_input_len < 4 or args.max_output_len < 1):
        raise ValueError("sharegpt needs --max-input-len >= 4 and --max-output-len >= 1")
    if args.workload == "multi-turn":
        check_multi_turn(args)
    if args.workload == "shared-prefix" and (args.num_groups < 1 or args.prefix_len < 1):
        raise ValueError("shared-prefix needs --num-groups >= 1 and --prefix-len >= 1")
    if not 0 <= args.min_token_id < args.max_token_id:
        raise ValueError("need 0 <= --min-token-id < --max-token-id")
    if args.mix and (not args.launch or args.transport != "http" or args.workload == "multi-turn"):
        raise ValueError("--mix needs --launch, --transport http and a one-turn workload")
    if args.mix and min(args.mix_batch_requests, args.mix_batch_output_len) < 1:
        raise ValueError("--mix-batch-requests and --mix-batch-output-len must be >= 1")
    if args.transport == "grpc" and args.endpoint == "chat":
        raise ValueError("--endpoint chat is HTTP only")
    urls, targets = args.url.split(","), args.target.split(",")
    if len(urls) > 1 and len(targets) > 1 and len(urls) != len(targets):
        raise ValueError("--url and --target must list the same servers, in the same order")
    if not args.launch:
        for url in urls:
            check_loopback(urlsplit(url).hostname or "")
        for target in targets:
            check_loopback(target.rsplit(":", 1)[0].strip("[]"))


def check_multi_turn(args: argparse.Namespace) -> None:
    if args.endpoint == "chat":
        raise ValueError(
            "--workload multi-turn sends token-id prompts (each turn resends the history as "
            "ids): use --endpoint completions"
        )
    if args.transport == "http" and args.tokenizer and not Path(args.tokenizer).is_file():
        raise ValueError(f"--tokenizer {args.tokenizer}: no such file")
    if min(args.num_conversations, args.turns, args.turn_input_len, args.input_len) < 1:
        raise ValueError(
            "multi-turn needs --num-conversations, --turns, --turn-input-len, --input-len >= 1"
        )
    if args.think_time_s < 0:
        raise ValueError("--think-time-s must be >= 0")


def rate_seed(seed: int, rate: float) -> int:
    """The seed of the run at `rate`: by the rate's value (seed + 1000 x rate, rounded; all at
    once, inf: seed), not its place in --rate, so runs at one rate draw the same arrivals and
    prompts whatever list they came in, and a server's runs at different rates share no
    prompts."""
    return seed if math.isinf(rate) else seed + round(rate * 1000)


def rate_runs(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One copy of args per --rate, with that `rate` and its seed (rate_seed)."""
    runs = []
    for rate in args.rates:
        run = copy.copy(args)
        run.rate, run.seed = rate, rate_seed(args.seed, rate)
        runs.append(run)
    return runs
