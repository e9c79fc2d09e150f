"""Load generator for the kvrelay router: sends a seeded workload (random token prompts, groups
sharing a long system prompt, ShareGPT-like lengths, or multi-turn conversations whose turns
resend the growing history) over HTTP/SSE or gRPC at one or more arrival rates (one run each)
and reports goodput under a TTFT/TPOT SLO first, then TTFT, TPOT, ITL and end-to-end latency
percentiles, throughput and the prefix hit rate; with --json also PNG plots beside it
(bench/lib/serve_plots.py, matplotlib). Owns no state beyond one run (and, with --launch, the
`kvrelay serve` process it starts and, with --watch-pools, the pool watcher).

    python -m bench.serve_bench --launch --transport http --num-requests 64 --rate 4
    kvrelay bench --launch --num-requests 64 --rate 4     # the same, from an installed checkout
    python -m bench.serve_bench --launch --num-requests 64 --rate 1 2 4 --json out.json \\
        --slo-ttft-ms 1000 --slo-tpot-ms 50
    python -m bench.serve_bench --url http://127.0.0.1:8000 --workload shared-prefix \\
        --num-groups 8 --prefix-len 512 --input-len 32 --output-len 16 --json out.json
    python -m bench.serve_bench --launch --workload sharegpt --max-input-len 1024 \\
        --max-output-len 256 --num-requests 200 --rate 2 4 8 --json sharegpt.json
    python -m bench.serve_bench --launch --transport grpc --workload multi-turn \\
        --num-conversations 16 --turns 4 --input-len 256 --turn-input-len 32 --output-len 32 \\
        --rate 1 --json chat.json     # --rate: conversations started per second
    python -m bench.serve_bench --url http://127.0.0.1:8100 --workload multi-turn \\
        --tokenizer MODEL_DIR/tokenizer.json --num-conversations 16 --turns 4 --rate 1 \\
        --json chat_http.json     # over HTTP (e.g. vLLM): each output's text re-tokenized
    python -m bench.serve_bench --launch --decode 1 --server-args '--autoscale-decode 1:4' \\
        --watch-pools --num-requests 400 --rate 2 8 --json autoscale.json
    python -m bench.serve_bench --launch --mix --num-requests 16 --rate 1 --input-len 64 \\
        --output-len 8 --mix-batch-requests 24 --mix-batch-output-len 48 --json mix.json
        # interactive requests beside a batch key's flood, with and without priorities
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from bench.lib.mixed_load import MODES, run_mix
from bench.lib.pool_watch import PoolSample, PoolWatch
from bench.lib.prefill_counts import counts_between, prefill_counts
from bench.lib.prefix_probe import prefill_holders, redis_url_from_log
from bench.lib.serve_args import build_parser, check_args, rate_runs
from bench.lib.serve_launch import (
    LaunchedServer,
    command_line,
    interrupt_on_signal,
    machine_info,
)
from bench.lib.serve_plots import (
    INSTALL_HINT,
    PlotRun,
    RunWindow,
    have_matplotlib,
    rate_label,
    write_plots,
)
from bench.lib.serve_run import BenchRun, run_conversations
from bench.lib.serve_stats import Slo, format_table
from bench.lib.serve_workload import (
    Conversation,
    build_conversations,
    build_requests,
    group_prefixes,
    single_turns,
    with_chat_text,
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Outcome(NamedTuple):
    """What run() measured: the launched server's description ({} without --launch), the runs,
    and with --watch-pools the pool samples and each run's span on their clock."""

    server: dict[str, Any]
    runs: list[BenchRun]
    pool_sizes: list[PoolSample]
    windows: list[RunWindow]


def run(args: argparse.Namespace) -> Outcome:
    """Each --rate's run against --url/--target, or against one server launched for them all."""
    if not args.launch:
        with watching(args, None) as watch:
            return run_all(args, args.url, args.target, lambda: args.redis_url, watch)
    with contextlib.ExitStack() as stack:
        state_dir = None  # --watch-pools: a state folder of its own, found whatever else runs
        if args.watch_pools:
            state_dir = Path(stack.enter_context(tempfile.TemporaryDirectory("serve_bench")))
        server = LaunchedServer(
            args.prefill,
            args.decode,
            args.policy,
            shlex.split(args.server_args),
            args.startup_timeout,
            worker_niceness=args.worker_niceness,
            server_root=args.server_root,
            state_dir=state_dir,
        )

        def redis_url() -> str | None:
            return redis_url_from_log(server.log_path.read_text(errors="replace"))

        stack.enter_context(server)
        watch = stack.enter_context(watching(args, state_dir))
        outcome = run_all(args, server.http_url, server.grpc_target, redis_url, watch)
        described = {"command": server.describe(), "startup_s": server.startup_s}
        return outcome._replace(server=described)


@contextlib.contextmanager
def watching(args: argparse.Namespace, state_dir: Path | None) -> Iterator[PoolWatch | None]:
    """A PoolWatch for --watch-pools (stopped on exit), else None."""
    if not args.watch_pools:
        yield None
        return
    with PoolWatch(state_dir, log=log) as watch:
        yield watch


def run_all(
    args: argparse.Namespace,
    url: str,
    target: str,
    redis_url: Callable[[], str | None],
    watch: PoolWatch | None,
) -> Outcome:
    runs, windows = [], []
    for rate_args in rate_runs(args):
        bench = run_rate(rate_args, url, target, redis_url)
        runs.append(bench)
        if watch is not None:  # the run ended now; it sent its first request duration_s before
            end = watch.now()
            start = end - bench.report["summary"]["duration_s"]
            windows.append(RunWindow(rate_label(bench.report["rate"]), start, end))
            bench.report["pool_watch_window_s"] = [start, end]
    return Outcome({}, runs, list(watch.samples) if watch else [], windows)


def workload(args: argparse.Namespace) -> list[Conversation]:
    if args.workload == "multi-turn":
        return build_conversations(args)
    requests = build_requests(args)
    if args.endpoint == "chat":
        requests = with_chat_text(requests, args.tokenizer)
    return single_turns(requests)


def run_rate(
    args: argparse.Namespace, url: str, target: str, redis_url: Callable[[], str | None]
) -> BenchRun:
    """One rate (args.rate, args.seed: one of serve_args.rate_runs): its workload, the run, and
    the prefix index probed after it."""
    if len(args.rates) > 1:
        log(f"rate {args.rate:g}/s, seed {args.seed}")
    before = prefill_counts(url)
    bench = asyncio.run(run_conversations(args, workload(args), url, target))
    bench.report["prefills_by_where"] = counts_between(before, prefill_counts(url))
    rate = None if math.isinf(args.rate) else args.rate  # None: all at once (JSON has no inf)
    bench.report["rate"], bench.report["seed"] = rate, args.seed
    bench.report["prefix_index"] = probe_prefixes(args, bench.report, redis_url())
    return bench


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


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """The command line (`prog`: the name its help shows, e.g. "kvrelay bench")."""
    parser = build_parser(__doc__)
    parser.prog = prog or parser.prog
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as e:
        log(f"error: {e}")
        return 2
    # Ctrl-C and SIGTERM stop the run (and a launched server), even when started in the
    # background with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt_on_signal)
    report: dict[str, Any] = {
        "label": args.label,
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": command_line("bench.serve_bench", argv),
        "config": {
            k: v if isinstance(v, int | str | None) else str(v) for k, v in vars(args).items()
        },
        "machine": machine_info(),
    }
    if args.mix:
        return run_mixed(args, report)
    try:
        outcome = run(args)
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    runs = outcome.runs
    if outcome.server:
        report["server"] = outcome.server
    if len(runs) == 1:  # one rate: the run's fields at the top, as before --rate took several
        report.update(runs[0].report)
    else:
        report["runs"] = [bench.report for bench in runs]
    if args.watch_pools:
        report["pool_sizes"] = [sample._asdict() for sample in outcome.pool_sizes]
    report["machine_after"] = {"loadavg_1_5_15": machine_info()["loadavg_1_5_15"]}
    title = f"serve_bench {args.label or ''} [{args.transport}, {args.workload}]".replace("  ", " ")
    for bench in runs:
        rate = rate_label(bench.report["rate"])
        print_run(bench.report, title if len(runs) == 1 else f"{title} {rate}")
    if args.json:
        report["plots"] = [str(path) for path in plot_runs(args, outcome, title)]
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0 if all(bench.report["summary"]["failed"] == 0 for bench in runs) else 1


def run_mixed(args: argparse.Namespace, report: dict[str, Any]) -> int:
    """--mix (bench/lib/mixed_load.py) at the first --rate."""
    try:
        report["mix"] = run_mix(rate_runs(args)[0])
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    modes = [report["mix"][mode] for mode in MODES]
    return 0 if all(m[side]["failed"] == 0 for m in modes for side in m) else 1


def print_run(report: dict[str, Any], title: str) -> None:
    print(format_table(report["summary"], title))
    if prefills := report.get("prefills_by_where"):
        where = ", ".join(f"{name} {count:g}" for name, count in prefills.items())
        print(f"prefills (warm-up included): {where}")
    if probe := report.get("prefix_index"):
        print(
            f"prefix index: prefill copies per group {probe['prefill_copies_per_group']}"
            f" (mean {probe['mean_prefill_copies']:.2f}); prefill hit rate <="
            f" {probe['prefill_hit_rate_upper_bound']:.1%}"
        )


def plot_runs(args: argparse.Namespace, outcome: Outcome, title: str) -> list[Path]:
    """The PNG plots beside the JSON; none (and one line saying so) without matplotlib."""
    if not have_matplotlib():
        log(f"plots skipped: matplotlib is not installed ({INSTALL_HINT})")
        return []
    plot = [PlotRun(b.report["rate"], b.results, b.report["summary"]) for b in outcome.runs]
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    paths = write_plots(args.json, plot, title.strip(), slo, outcome.pool_sizes, outcome.windows)
    log(f"wrote {', '.join(str(path) for path in paths)}")
    return paths


if __name__ == "__main__":
    sys.exit(main())
