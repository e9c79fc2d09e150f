"""Aggregates RequestResults into a serving summary (goodput under a latency SLO, latency
percentiles, throughput, prefix hit rate, per-turn figures of multi-turn runs) and renders it
as a text table; stateless.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from bench.lib.serve_client import RequestResult

PERCENTILES = (50, 90, 99)


class Slo(NamedTuple):
    """The latency objective a request must meet to count as good (milliseconds)."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 100.0


class Goodput(NamedTuple):
    num_good: int
    goodput_req_s: float  # good requests / duration
    slo_attainment: float  # good requests / all requests (failed ones included)


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """Completed, TTFT <= slo.ttft_ms and TPOT <= slo.tpot_ms; a request with one output token
    has no TPOT and is judged on its TTFT alone."""
    if not result.ok or result.ttft_s is None or 1e3 * result.ttft_s > slo.ttft_ms:
        return False
    tpot_s = result.tpot_s
    return tpot_s is None or 1e3 * tpot_s <= slo.tpot_ms


def goodput(results: Sequence[RequestResult], duration_s: float, slo: Slo) -> Goodput:
    num_good = sum(meets_slo(r, slo) for r in results)
    rate = num_good / duration_s if duration_s > 0 else 0.0
    return Goodput(num_good, rate, num_good / len(results) if results else 0.0)


def per_turn(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Multi-turn runs: per turn index, its completed count, TTFT p50 and prefix hit rate."""
    rows = []
    for turn in sorted({r.turn for r in results}):
        ok = [r for r in results if r.ok and r.turn == turn]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in ok)
        rows.append(
            {
                "turn": turn,
                "completed": len(ok),
                "ttft_p50_ms": distribution_ms(ttfts)["p50"],
                "mean_prompt_tokens": prompt / len(ok) if ok else None,
                "prefix_hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
            }
        )
    return rows


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values_s, dtype=np.float64) * 1000.0
    stats = {"mean": float(arr.mean())}
    stats.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return stats


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: Slo | None = None
) -> dict[str, Any]:
    """duration_s: first send to last completion (the throughput denominator); slo: what
    goodput counts (default Slo()). Multi-turn results (a turn > 0) add "per_turn"."""
    slo = slo or Slo()
    good = goodput(results, duration_s, slo)
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    num_chunks = sum(len(r.token_times) for r in ok)
    itls = [gap for r in ok for gap in r.itls_s()]
    summary = {
        "slo": slo._asdict(),
        "num_good": good.num_good,
        "goodput_req_s": good.goodput_req_s,
        "slo_attainment": good.slo_attainment,
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
    if any(r.turn > 0 for r in results):
        summary["per_turn"] = per_turn(results)
    return summary


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(summary: dict[str, Any], title: str = "") -> str:
    """A fixed-width table of one summary."""
    lines = [title] if title else []
    slo = summary["slo"]
    lines.append(
        f"goodput {summary['goodput_req_s']:.2f} req/s: {summary['num_good']}"
        f"/{summary['num_requests']} requests ({summary['slo_attainment']:.1%}) met the SLO"
        f" TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms"
    )
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
    for row in summary.get("per_turn", []):
        hit = f"prefix hit rate {row['prefix_hit_rate']:.1%}"
        lines.append(
            f"turn {row['turn']}: {row['completed']} ok, TTFT p50 {_fmt(row['ttft_p50_ms'])} ms,"
            f" mean prompt {_fmt(row['mean_prompt_tokens'], 0)} tokens, {hit}"
        )
    for error in summary["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)
