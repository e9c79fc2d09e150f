"""PNG plots of serve_bench's runs, written beside its JSON: TTFT and ITL CDFs (a line per rate)
and, when two or more finite rates ran, throughput and p50/p99 latency against the offered
rate. matplotlib (the optional `bench` extra), Agg backend, imported only here; stateless.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.serve_client import RequestResult

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

    def itls_ms(self) -> list[float]:
        return [1e3 * gap for r in self.results if r.ok for gap in r.itls_s()]


def have_matplotlib() -> bool:
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return False
    return True


def write_plots(json_path: Path, runs: Sequence[PlotRun], title: str) -> list[Path]:
    """NAME.ttft_cdf.png and NAME.itl_cdf.png beside NAME.json, and with two or more finite
    rates NAME.throughput_vs_rate.png and NAME.latency_vs_rate.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    def path(kind: str) -> Path:
        return json_path.with_suffix(f".{kind}.png")

    paths = [
        cdf_plot(plt, path("ttft_cdf"), runs, PlotRun.ttfts_ms, "TTFT (ms)", f"{title}: TTFT"),
        cdf_plot(
            plt, path("itl_cdf"), runs, PlotRun.itls_ms, "inter-token latency (ms)", f"{title}: ITL"
        ),
    ]
    rated = sorted((run for run in runs if run.rate is not None), key=lambda run: run.rate or 0)
    if len(rated) >= 2:
        paths.append(throughput_plot(plt, path("throughput_vs_rate"), rated, title))
        paths.append(latency_plot(plt, path("latency_vs_rate"), rated, title))
    return paths


def cdf_plot(
    plt: Any,
    path: Path,
    runs: Sequence[PlotRun],
    values_ms: Callable[[PlotRun], list[float]],
    xlabel: str,
    title: str,
) -> Path:
    """Empirical CDF of values_ms, a step line per run; log x when the values span > 50x."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    low, high = math.inf, 0.0
    for run in runs:
        values = np.sort(np.asarray(values_ms(run), dtype=np.float64))
        if len(values) == 0:
            continue
        fraction = np.arange(1, len(values) + 1) / len(values)
        ax.step(values, fraction, where="post", label=f"{run.label} (n={len(values)})")
        low, high = min(low, values[0]), max(high, values[-1])
    if low > 0 and high > 50 * low:
        ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel="fraction <= x", ylim=(0, 1.02), title=title)
    ax.legend(loc="lower right")
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
