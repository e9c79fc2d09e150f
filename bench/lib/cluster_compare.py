"""The cluster-vs-aggregated comparison of bench.gpu_cluster_bench: one row per setup and run
(from each run's serve_stats summary) and the text table with its caveats; stateless.
"""

from __future__ import annotations

from typing import Any

SETUPS = (("cluster", "cluster (1P+1D)"), ("aggregated", "aggregated ({n} engines)"))


def comparison_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ordered by run, the setups of one run next to each other; skipped runs left out."""
    rows = []
    for key, name in SETUPS:
        section = report.get(key) or {}
        setup = name.format(n=len(section.get("engines") or []) or "?")
        for order, run in enumerate(section.get("runs") or []):
            if "summary" in run:
                rows.append(row(setup, order, run))
    rows.sort(key=lambda r: r["run"])
    return rows


def row(setup: str, order: int, run: dict[str, Any]) -> dict[str, Any]:
    s = run["summary"]
    return {
        "setup": setup,
        "run": order,
        "rate": run["rate"],
        "num_requests": s["num_requests"],
        "completed": s["completed"],
        "failed": s["failed"],
        "output_len_mismatches": s["output_len_mismatches"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "ttft_p99_ms": s["ttft_ms"]["p99"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        "tpot_p99_ms": s["tpot_ms"]["p99"],
        "output_tok_s": s["output_throughput"],
        "duration_s": s["duration_s"],
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_comparison(report: dict[str, Any]) -> str:
    gpus = sorted({g.get("name", "?") for g in report["machine"].get("gpus") or []})
    config = report["config"]
    vocab, shape_vocab = (
        report["model"]["hf_config"]["vocab_size"],
        report["model"]["shape_vocab_size"],
    )
    vocab_note = (
        f" vocab {vocab:,} not {shape_vocab:,} (the router needs the SmolLM2 tokenizer);"
        if vocab != shape_vocab
        else ""
    )
    lines = [
        f"{report['model']['shape']} shape, random {config['dtype']} weights,{vocab_note}"
        f" {config['input_len']} in / {config['output_len']} out (ignore_eos), Poisson arrivals;"
        f" {', '.join(gpus) or 'GPU ?'}",
    ]
    header = (
        f"{'setup':<24}{'rate':>6}{'ok/reqs':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'out tok/s':>11}{'dur s':>8}"
    )
    lines += [header, "-" * len(header)]
    for r in report.get("comparison") or []:
        ok = f"{r['completed']}/{r['num_requests']}"
        lines.append(
            f"{r['setup']:<24}{r['rate']:>6g}{ok:>10}"
            f"{_ms(r['ttft_p50_ms']):>10}{_ms(r['ttft_p99_ms']):>10}"
            f"{_ms(r['tpot_p50_ms']):>10}{_ms(r['tpot_p99_ms']):>10}"
            f"{r['output_tok_s']:>11.1f}{r['duration_s']:>8.1f}"
        )
    lines += notes(report)
    return "\n".join(lines)


def notes(report: dict[str, Any]) -> list[str]:
    out = [
        "TTFT and TPOT in ms; out tok/s: output tokens / (first arrival to last completion)",
        "aggregated: in-process engines, no router/HTTP/gRPC/KV transfer in the path (favours"
        " it); TTFT counted from each request's arrival time",
    ]
    for key, _ in SETUPS:
        section = report.get(key)
        if section is None:
            continue
        if "error" in section:
            out.append(f"{key}: {section['error'].splitlines()[0][:200]}")
        for run in section.get("runs") or []:
            if "skipped" in run:
                out.append(f"{key} {run['label']}: skipped ({run['skipped']})")
            elif errors := run["summary"]["errors"]:
                out.append(f"{key} {run['label']}: errors {errors}")
    return out
