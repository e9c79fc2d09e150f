"""PNG plots of serve_bench's runs, written beside its JSON: TTFT, TPOT and ITL CDFs (a line
per rate, the SLO marked); when two or more finite rates ran, goodput, throughput and p50/p99
latency against the offered rate; with --watch-pools, the pools' sizes over time. matplotlib
(the optional `bench` extra), Agg backend, imported only here; stateless.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bench.lib.pool_watch import PoolSample
from bench.lib.serve_client import RequestResult
from bench.lib.serve_stats import Slo

INSTALL_HINT = 'pip install -e ".[bench]"'
PERCENTILES = ("p50", "p99")


def rate_label(rate: float | None) -> str:
    return "all at once" if rate is None else f"{rate:g} req/s"


@dataclass(frozen=True)
class PlotRun:
    """One rate's run: the offered rate (None: all at once), its results and their summary."""

    rate: float | None
    results: Sequence[RequestResult]
    summary: dict[str, Any]

    @property
    def label(self) -> str:
        return rate_label(self.rate)

    def ttfts_ms(self) -> list[float]:
        return [1e3 * r.ttft_s for r in self.results if r.ok and r.ttft_s is not None]

    def tpots_ms(self) -> list[float]:
        return [1e3 * r.tpot_s for r in self.results if r.ok and r.tpot_s is not None]

    def itls_ms(self) -> list[float]:
        return [1e3 * gap for r in self.results if r.ok for gap in r.itls_s()]


class RunWindow(NamedTuple):
    """When one run sent its requests, on the pool watch's clock (seconds)."""

    label: str
    start_s: float
    end_s: float


def slo_label(slo: Slo) -> str:
    return f"SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms"


def have_matplotlib() -> bool:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def write_plots(
    json_path: Path,
    runs: Sequence[PlotRun],
    title: str,
    slo: Slo,
    pool_sizes: Sequence[PoolSample] = (),
    windows: Sequence[RunWindow] = (),
) -> list[Path]:
    """NAME.{ttft,tpot,itl}_cdf.png beside NAME.json; with two or more finite rates
    NAME.{goodput,throughput,latency}_vs_rate.png; with pool samples NAME.pool_sizes.png.
    Returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    def path(kind: str) -> Path:
        return json_path.with_suffix(f".{kind}.png")

    cdfs = (
        ("ttft", PlotRun.ttfts_ms, "TTFT (ms)", slo.ttft_ms),
        ("tpot", PlotRun.tpots_ms, "time per output token (ms)", slo.tpot_ms),
        ("itl", PlotRun.itls_ms, "inter-token latency (ms)", None),
    )
    paths = [
        cdf_plot(plt, path(f"{name}_cdf"), runs, values, xlabel, f"{title}: {name.upper()}", mark)
        for name, values, xlabel, mark in cdfs
    ]
    rated = sorted((run for run in runs if run.rate is not None), key=lambda run: run.rate or 0)
    if len(rated) >= 2:
        paths.append(goodput_plot(plt, path("goodput_vs_rate"), {"": rated}, slo, title))
        paths.append(throughput_plot(plt, path("throughput_vs_rate"), rated, title))
        paths.append(latency_plot(plt, path("latency_vs_rate"), rated, title))
    if pool_sizes:
        paths.append(pool_plot(plt, path("pool_sizes"), pool_sizes, windows, title))
    return paths


def cdf_plot(
    plt: Any,
    path: Path,
    runs: Sequence[PlotRun],
    values_ms: Callable[[PlotRun], list[float]],
    xlabel: str,
    title: str,
    slo_ms: float | None = None,
) -> Path:
    """Empirical CDF of values_ms, a step line per run, the SLO a dashed vertical line; log x
    when the values span > 50x."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    low, high = math.inf, 0.0
    for run in runs:
        values = np.sort(np.asarray(values_ms(run), dtype=np.float64))
        if len(values) == 0:
            continue
        fraction = np.arange(1, len(values) + 1) / len(values)
        ax.step(values, fraction, where="post", label=f"{run.label} (n={len(values)})")
        low, high = min(low, values[0]), max(high, values[-1])
    if slo_ms is not None:
        ax.axvline(slo_ms, color="red", linestyle="--", linewidth=1, label=f"SLO {slo_ms:g} ms")
    if low > 0 and high > 50 * low:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="fraction <= x", ylim=(0, 1.02), title=title)
    ax.legend(loc="lower right")
    return save(plt, fig, path)


def goodput_plot(
    plt: Any, path: Path, sets: Mapping[str, Sequence[PlotRun]], slo: Slo, title: str
) -> Path:
    """Goodput (left panel) and SLO attainment (right) against the offered rate, a line per
    run set (its label; "" for serve_bench's one), the offered rate dotted for reference."""
    fig, (good, attained) = plt.subplots(1, 2, figsize=(11, 4.5))
    all_rates: set[float] = set()
    for name, runs in sets.items():
        rates = [run.rate for run in runs]
        all_rates.update(r for r in rates if r is not None)
        good.plot(rates, [run.summary["goodput_req_s"] for run in runs], "o-", label=name or None)
        attained.plot(rates, [100 * run.summary["slo_attainment"] for run in runs], "o-")
    offered = sorted(all_rates)
    good.plot(offered, offered, ":", color="gray", label="offered")
    good.set(ylabel="good requests/s", title=f"{title}: goodput\n{slo_label(slo)}")
    good.legend()
    attained.set(ylabel="requests meeting the SLO (%)", title=f"SLO attainment\n{slo_label(slo)}")
    attained.set_ylim(0, 102)
    for ax in (good, attained):
        ax.set(xlabel="offered rate (req/s)")
        ax.set_ylim(bottom=0)
    return save(plt, fig, path)


def pool_plot(
    plt: Any, path: Path, samples: Sequence[PoolSample], windows: Sequence[RunWindow], title: str
) -> Path:
    """Ready workers per pool over time as steps (wanted: dashed), each run's span shaded."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    t = [s.t_s for s in samples]
    for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
        ready = [getattr(s, f"{role}_ready") for s in samples]
        desired = [getattr(s, f"{role}_desired") for s in samples]
        ax.step(t, ready, where="post", color=color, label=f"{role} ready")
        ax.step(
            t, desired, where="post", color=color, linestyle="--", alpha=0.6, label=f"{role} wanted"
        )
    for i, window in enumerate(windows):
        ax.axvspan(window.start_s, window.end_s, color="gray", alpha=0.08 + 0.06 * (i % 2))
        ax.annotate(window.label, (window.start_s, 0), xytext=(2, 2), textcoords="offset points")
    top = max(
        max(s.prefill_ready, s.decode_ready, s.prefill_desired, s.decode_desired) for s in samples
    )
    ax.set(xlabel="time (s)", ylabel="workers", ylim=(0, top + 1), title=f"{title}: pool sizes")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left")
    return save(plt, fig, path)


def throughput_plot(plt: Any, path: Path, runs: Sequence[PlotRun], title: str) -> Path:
    """Output tok/s (left panel) and completed req/s beside the offered rate (right) against
    the offered rate."""
    rates = [run.rate for run in runs]
    fig, (tokens, requests) = plt.subplots(1, 2, figsize=(11, 4.5))
    tokens.plot(rates, [run.summary["output_throughput"] for run in runs], "o-")
    tokens.set(ylabel="output tokens/s", title=f"{title}: output throughput")
    completed = [run.summary["request_throughput"] for run in runs]
    requests.plot(rates, completed, "o-", label="completed")
    requests.plot(rates, rates, ":", color="gray", label="offered")
    requests.set(ylabel="requests/s", title=f"{title}: request throughput")
    requests.legend()
    for ax in (tokens, requests):
        ax.set(xlabel="offered rate (req/s)")
        ax.set_ylim(bottom=0)
    return save(plt, fig, path)


def latency_plot(plt: Any, path: Path, runs: Sequence[PlotRun], title: str) -> Path:
    """p50 and p99 of TTFT (left panel) and ITL (right) against the offered rate."""
    rates = [run.rate for run in runs]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric, name in zip(axes, ("ttft_ms", "itl_ms"), ("TTFT", "ITL"), strict=True):
        for p in PERCENTILES:
            values = [run.summary[metric][p] for run in runs]
            ax.plot(rates, [math.nan if v is None else v for v in values], "o-", label=p)
        ax.set(xlabel="offered rate (req/s)", ylabel=f"{name} (ms)", title=f"{title}: {name}")
        ax.set_ylim(bottom=0)
        ax.legend()
    return save(plt, fig, path)


def save(plt: Any, fig: Any, path: Path) -> Path:
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
