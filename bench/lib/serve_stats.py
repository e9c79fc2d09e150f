"""Aggregates RequestResults into a serving summary (latency percentiles, throughput, prefix hit
rate) and renders it as a text table; stateless.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.lib.serve_client import RequestResult

PERCENTILES = (50, 90, 99)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {"mean": float(arr.mean())}
    stats.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return stats


def summarize(results: Sequence[RequestResult], duration_s: float) -> dict[str, Any]:
    """duration_s: first send to last completion (the throughput denominator)."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    num_chunks = sum(len(r.token_times) for r in ok)
    itls = [gap for r in ok for gap in r.itls_s()]
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_len_mismatches": sum(r.output_tokens != r.expected_output_tokens for r in ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": output / duration_s if duration_s > 0 else 0.0,
        "total_prompt_tokens": prompt,
        "total_cached_tokens": cached,
        "total_output_tokens": output,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "tokens_per_chunk": output / num_chunks if num_chunks else 0.0,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": distribution_ms(itls),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok]),
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(summary: dict[str, Any], title: str = "") -> str:
    """A fixed-width table of one summary."""
    lines = [title] if title else []
    lines.append(
        f"requests {summary['completed']}/{summary['num_requests']} ok"
        f" ({summary['failed']} failed, {summary['output_len_mismatches']} with other output"
        f" length) in {summary['duration_s']:.2f} s"
    )
    lines.append(
        f"throughput {summary['request_throughput']:.2f} req/s,"
        f" {summary['output_throughput']:.1f} output tok/s;"
        f" prefix hit rate {summary['prefix_hit_rate']:.1%}"
        f" ({summary['total_cached_tokens']}/{summary['total_prompt_tokens']} prompt tokens);"
        f" {summary['tokens_per_chunk']:.2f} tokens/chunk"
    )
    header = f"{'metric (ms)':<12}{'mean':>10}" + "".join(f"{f'p{p}':>10}" for p in PERCENTILES)
    lines += [header, "-" * len(header)]
    for name in ("ttft", "tpot", "itl", "e2e"):
        dist = summary[f"{name}_ms"]
        cells = "".join(f"{_fmt(dist[f'p{p}']):>10}" for p in PERCENTILES)
        lines.append(f"{name.upper():<12}{_fmt(dist['mean']):>10}{cells}")
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
