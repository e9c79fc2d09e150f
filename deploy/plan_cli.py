"""`kvrelay plan`: recommends prefill and decode pool sizes for a described or recorded workload
and an SLO, from a pool profile (deploy/profile.py, measured by bench/pool_profile.py). Holds
no state and needs no cluster."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

from deploy.planner import Plan, Slo, Workload, plan, records_from_report, workload_from_records
from deploy.profile import load_profile


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="recommend pool sizes for a workload and SLO from a profile")
    p.add_argument(
        "--profile", type=Path, required=True, help="pool profile JSON (bench/pool_profile.py)"
    )
    p.add_argument("--rate", type=float, default=None, help="requests per second")
    p.add_argument("--input-len", type=float, default=None, help="mean prompt tokens")
    p.add_argument("--output-len", type=float, default=None, help="mean output tokens")
    p.add_argument(
        "--cached-fraction",
        type=float,
        default=0.0,
        help="mean fraction of each prompt already in a prefix cache (default 0)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="a serve_bench --json report: plan for its recorded requests instead",
    )
    p.add_argument(
        "--trace-run",
        type=int,
        default=None,
        help="of --trace's report with several rates, this run (default -1: the last)",
    )
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="time to first token")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="time per output token")
    p.add_argument("--max-workers", type=int, default=16, help="GPUs in all (default 16)")
    p.add_argument(
        "--utilisation-target",
        type=float,
        default=0.8,
        help="busiest each pool may be, for headroom (default 0.8)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the served model the plan is for: the scale command it prints names it (a "
        "cluster serving several models asks which)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=plan_command)


def workload_from_args(args: argparse.Namespace) -> tuple[Workload, str]:
    """The workload and a line saying where it came from."""
    described = (args.rate, args.input_len, args.output_len)
    if args.trace is not None:
        if any(value is not None for value in described):
            raise ValueError("give --trace or --rate/--input-len/--output-len, not both")
        try:
            report = json.loads(args.trace.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"trace {args.trace}: not JSON ({e})") from None
        run = -1 if args.trace_run is None else args.trace_run
        records = records_from_report(report, run)
        return workload_from_records(records), f"recorded: {len(records)} requests in {args.trace}"
    if args.trace_run is not None:
        raise ValueError("--trace-run picks a run of --trace's report: give --trace too")
    if any(value is None for value in described):
        raise ValueError("give --rate, --input-len and --output-len (or --trace)")
    workload = Workload(args.rate, args.input_len, args.output_len, args.cached_fraction)
    return workload, "described"


def plan_command(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    if args.model and not profile_is_of(profile.model, args.model):
        print(
            f"kvrelay plan: warning: {args.profile} measured {profile.model!r}, not "
            f"{args.model!r}: its figures may not be that model's (measure it with "
            "bench/pool_profile.py)",
            file=sys.stderr,
        )
    workload, source = workload_from_args(args)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    result = plan(profile, workload, slo, args.max_workers, args.utilisation_target)
    if args.json:
        print(json.dumps(plan_json(result, source, args.model), indent=2))
    else:
        print(format_plan(result, source, f"{profile.model}, {profile.device}", args.model))
    return 0 if result.feasible else 1


def profile_is_of(measured: str, model: str) -> bool:
    """Whether a profile's model names the served model: the same name, or a path ending in it
    (case aside)."""
    name = measured.rstrip("/").rsplit("/", 1)[-1].lower()
    return measured.lower() == model.lower() or name == model.rstrip("/").rsplit("/", 1)[-1].lower()


def scale_command(result: Plan, model: str | None = None) -> str:
    """The `kvrelay scale` call that sets the plan's pool sizes (on model's pools, if named)."""
    which = f" --model {shlex.quote(model)}" if model else ""
    return (
        f"kvrelay scale{which} --prefill {result.prefill.num_workers} "
        f"--decode {result.decode.num_workers}"
    )


def format_plan(result: Plan, source: str, measured: str, model: str | None = None) -> str:
    w, slo, p, d = result.workload, result.slo, result.prefill, result.decode
    lines = [
        f"profile: {measured}",
        f"workload ({source}): {w.rate:.2f} req/s, {w.input_len:.0f} prompt tokens "
        f"({w.cached_fraction:.0%} cached), {w.output_len:.0f} output tokens",
        f"SLO: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms; each pool at most "
        f"{result.utilisation_target:.0%} busy",
        "",
        f"{'pool':<9}{'workers':>8}  {'predicted':<44}{'utilisation':>11}",
        f"{'prefill':<9}{p.num_workers:>8}  "
        f"{f'TTFT {_ms(p.ttft_ms)} (a prefill alone {p.service_ms:.1f} ms)':<44}"
        f"{_pct(p.utilisation):>11}",
        f"{'decode':<9}{d.num_workers:>8}  "
        f"{f'TPOT {_ms(d.tpot_ms)} at batch {_num(d.batch)}, KV {_pct(d.kv_fraction)}':<44}"
        f"{_pct(d.utilisation):>11}",
        "",
    ]
    if result.feasible:
        lines.append(f"run: {scale_command(result, model)}  ({result.num_workers} workers)")
    else:
        lines.append(f"no pool sizes within --max-workers {result.max_workers} meet the SLO")
        lines.append("(the table shows the largest sizes tried):")
        lines += [f"  {f.objective}: {f.message}" for f in result.failures]
    return "\n".join(lines)


def plan_json(result: Plan, source: str, model: str | None = None) -> dict[str, Any]:
    w, slo = result.workload, result.slo
    return {
        "feasible": result.feasible,
        "command": scale_command(result, model) if result.feasible else None,
        "num_workers": result.num_workers,
        "prefill": _finite(vars(result.prefill)),
        "decode": _finite(vars(result.decode)),
        "failures": [f._asdict() for f in result.failures],
        "workload": {"source": source, **vars(w)},
        "slo": vars(slo),
        "utilisation_target": result.utilisation_target,
        "max_workers": result.max_workers,
    }


def _finite(values: dict[str, Any]) -> dict[str, Any]:
    """inf (a saturated pool) as null: JSON has no infinity."""
    return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in values.items()}


def _ms(value: float) -> str:
    return "unbounded" if math.isinf(value) else f"{value:.1f} ms"


def _pct(value: float) -> str:
    return "saturated" if math.isinf(value) else f"{value:.0%}"


def _num(value: float) -> str:
    return "-" if math.isinf(value) else f"{value:.1f}"
