"""Which BLAS library (cuBLAS or cuBLASLt, both through torch) runs each bf16 / fp16 projection at
each decode graph's row count: BlasLinear (an nn.Linear that owns its table of choices) and the
timing that fills the tables before each graph is captured; owns no other state but the setting
read once from the environment.

Why: torch's matmuls go to cuBLAS unless told otherwise, and cuBLAS's heuristic pick is not the
fastest at every row count. On the H200, the 8B projections at 384 rows took 7.81 ms a step on
cuBLAS against 7.67 on cuBLASLt, and cuBLAS's gate_up kernel at 384 rows comes with a device
memset whose gaps idle the GPU ~0.18 ms a step; at 16,384 and 232 rows cuBLAS was the faster
(bench/bf16_gemm_bench.py, bench/RESULTS.md). So the choice is timed per shape and row count
on the machine, not fixed.

KVRELAY_BLAS_TUNE: "0" (default: every projection on torch's default library) or "1" (time
both libraries for each group of same-shaped projections at each captured decode batch size
and keep the faster; some seconds more at start-up). Eager steps of other row
counts (prefill chunks) keep the default. Off by default until an offline run has measured it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

ENV = "KVRELAY_BLAS_TUNE"
LIBRARIES = ("cublas", "cublaslt")
TIMED_REPS = 3  # each library's time: the median of this many passes over a group's layers

# (layers of one shape, their input, library) -> seconds of one pass over the layers
Timer = Callable[[Sequence["BlasLinear"], torch.Tensor, str], float]


@functools.cache
def tuning_wanted() -> bool:
    """KVRELAY_BLAS_TUNE asks for the timed choice (read once; cache_clear to re-read)."""
    raw = os.environ.get(ENV, "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


@contextlib.contextmanager
def preferred_blas(library: str) -> Iterator[None]:
    """torch's matmuls on `library` inside the block (a process-wide setting, put back after)."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


class BlasLinear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys) that runs on the BLAS library chosen for
    its input's row count, where one was chosen; else on torch's default."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kwargs):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.blas_by_rows: dict[int, str] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        library = self.blas_by_rows.get(x.shape[0]) if self.blas_by_rows else None
        if library is None:
            return F.linear(x, self.weight, self.bias)
        with preferred_blas(library):
            return F.linear(x, self.weight, self.bias)


def layers_by_shape(model: nn.Module) -> dict[tuple[int, int], list[BlasLinear]]:
    """The model's BlasLinear layers, grouped by (out_features, in_features)."""
    groups: dict[tuple[int, int], list[BlasLinear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, BlasLinear):
            groups[(module.out_features, module.in_features)].append(module)
    return dict(groups)


def time_on_gpu(layers: Sequence[BlasLinear], x: torch.Tensor, library: str) -> float:
    """Seconds of one pass of x through every layer on `library` (CUDA events; one pass first
    to warm the library up). Passing through all of a shape's layers, each with its own weight,
    reads the weights from HBM as a step does instead of from L2."""

    def one_pass() -> None:
        for layer in layers:
            F.linear(x, layer.weight, layer.bias)

    with preferred_blas(library):
        one_pass()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        one_pass()
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / 1e3


@torch.inference_mode()
def tune_rows(model: nn.Module, num_rows: int, timer: Timer = time_on_gpu) -> dict[str, str]:
    """Time each group of same-shaped projections at num_rows rows on every library and record
    the fastest in their tables. Returns "out x in" -> the library chosen, for the log."""
    chosen = {}
    for (out_features, in_features), layers in layers_by_shape(model).items():
        weight = layers[0].weight
        x = torch.randn(num_rows, in_features, dtype=weight.dtype, device=weight.device)
        seconds = {
            library: statistics.median(timer(layers, x, library) for _ in range(TIMED_REPS))
            for library in LIBRARIES
        }
        best = min(LIBRARIES, key=seconds.__getitem__)  # a tie keeps the default (first)
        for layer in layers:
            layer.blas_by_rows[num_rows] = best
        chosen[f"{out_features}x{in_features}"] = best
    return chosen


def chosen_libraries(model: nn.Module) -> dict[int, dict[str, str]]:
    """Row count -> "out x in" -> library, over the model's tables (for reports)."""
    table: dict[int, dict[str, str]] = defaultdict(dict)
    for (out_features, in_features), layers in layers_by_shape(model).items():
        for num_rows, library in layers[0].blas_by_rows.items():
            table[num_rows][f"{out_features}x{in_features}"] = library
    return {rows: table[rows] for rows in sorted(table)}


def blas_summary(model: nn.Module) -> str:
    """One line: how many of the tuned (batch size, projection shape) pairs went to each library,
    and the largest batch size's picks."""
    table = chosen_libraries(model)
    if not table:
        return "none tuned"
    picks = [library for by_shape in table.values() for library in by_shape.values()]
    counts = ", ".join(f"{library} {picks.count(library)}" for library in LIBRARIES)
    largest = max(table)
    at_largest = ", ".join(f"{shape} {library}" for shape, library in table[largest].items())
    return f"{counts} of {len(picks)} (size, shape) pairs; at {largest}: {at_largest}"
