"""Which GEMM library runs each bf16 / fp16 projection at each decode graph's batch size (torch's
cuBLAS, torch's cuBLASLt, or FlashInfer's mm_bf16 on cuBLASLt at the algorithm its autotuner found
fastest for exactly that row count): BlasLinear (an nn.Linear that owns its table of choices) and
the timing that fills the tables before each graph is captured; owns no other state but the setting
read once from the environment, whether the tables are in force (only while a decode graph is
warmed up and captured) and the shapes whose FlashInfer refusal it logged (FlashInfer's
autotuner keeps the algorithms it found).

Why: torch's matmuls go to cuBLAS unless told otherwise, and cuBLAS's heuristic pick is not the
fastest at every row count. On the H200, the 8B projections at 384 rows took 7.81 ms a step on
cuBLAS against 7.67 on cuBLASLt, and cuBLAS's gate_up kernel at 384 rows comes with a device memset
whose gaps idle the GPU ~0.18 ms a step; at 16,384 and 232 rows cuBLAS was the faster
(bench/bf16_gemm_bench.py, bench/RESULTS.md). FlashInfer's tuned cuBLASLt was 6.5% faster at 768
rows and 4% at 232. So the choice is timed per shape and row count on the machine, not fixed.
FlashInfer is a candidate only for bf16 layers without a bias, on CUDA where it imports.

Every step not replayed from a decode graph (eager prefill and mixed steps, piecewise graphs) keeps
torch's default, whatever its row count: the tables are read only inside choices_in_force. Tuned as
well, the 8B run's prefill steps gained nothing measurable (bench/RESULTS.md, fourteenth round; the
extra GPU idle seen then was within the fifteenth round's run-to-run spread).

KVRELAY_BLAS_TUNE: "0" (default: every projection on torch's default library) or "1" (time the
libraries for each group of same-shaped projections at each captured decode batch size, as a
graph replay, and keep the fastest; ~20 s more start-up for the 8B shape's 51 sizes, logged).
Steps of other row counts keep the default. Off by default: the 8B bf16 offline run on an H200
moved +0.5% and +0.0% with the prefill rows tuned too, +0.05% with decode sizes only
(bench/RESULTS.md).

torch's library setting is process-wide: BlasLinear switches it around its own product and puts it
back, which is sound because one thread (the engine's) runs a model's GEMMs.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.env_flags import on_off

ENV = "KVRELAY_BLAS_TUNE"
TORCH_LIBRARIES = ("cublas", "cublaslt")  # torch's preferred BLAS backends
FLASHINFER = "flashinfer"  # flashinfer.mm_bf16 on cuBLASLt, at its autotuned algorithm
LIBRARIES = (*TORCH_LIBRARIES, FLASHINFER)
TIMED_REPS = 3  # each library's time: the median of this many replays of a pass over a group
TUNE_SEED = 0  # the timed input's values (the library's time does not depend on them)

logger = logging.getLogger(__name__)
_tables_in_force = contextvars.ContextVar("kvrelay_blas_tables_in_force", default=False)
_refusals_logged: set[tuple[int, int]] = set()  # shapes whose FlashInfer refusal was logged

# (layers of one shape, their input, library) -> seconds of one pass over the layers
Timer = Callable[[Sequence["BlasLinear"], torch.Tensor, str], float]


@functools.cache
def tuning_wanted() -> bool:
    """KVRELAY_BLAS_TUNE asks for the timed choice (read once; cache_clear to re-read)."""
    return on_off(ENV, default=False)


def library_in_force() -> str:
    """torch's preferred BLAS library now: "cublas" or "cublaslt" (also "default", "ck")."""
    return torch.backends.cuda.preferred_blas_library().name.lower()


@contextlib.contextmanager
def preferred_blas(library: str) -> Iterator[None]:
    """torch's matmuls on `library` inside the block (a process-wide setting, put back after;
    untouched when `library` is already in force)."""
    if library_in_force() == library:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


@functools.cache
def _flashinfer() -> Any:
    """flashinfer, or None where it does not import (CPU installs)."""
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def flashinfer_can_run(layer: nn.Linear) -> bool:
    """mm_bf16 takes this layer: bf16 weight on CUDA, no bias, FlashInfer installed."""
    return (
        layer.bias is None
        and layer.weight.is_cuda
        and layer.weight.dtype == torch.bfloat16
        and _flashinfer() is not None
    )


def flashinfer_linear(x: torch.Tensor, weight: torch.Tensor, tune: bool = False) -> torch.Tensor:
    """x @ weight^T through mm_bf16 on cuBLASLt, at the algorithm FlashInfer's autotuner found
    for exactly x's row count (tune=True: time its algorithms now and keep the fastest; a row
    count never tuned gets cuBLASLt's heuristic pick)."""
    flashinfer = _flashinfer()
    from flashinfer.autotuner import autotune

    with autotune(tune, tuning_buckets=(x.shape[0],)):
        return flashinfer.mm_bf16(x, weight.t(), backend="cublaslt")


def run_on(library: str, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer's product of x on `library`."""
    if library == FLASHINFER:
        return flashinfer_linear(x, layer.weight)
    with preferred_blas(library):
        return F.linear(x, layer.weight, layer.bias)


@contextlib.contextmanager
def choices_in_force() -> Iterator[None]:
    """Inside the block (a decode graph's warm-up and capture), BlasLinear layers run on the
    library their tables name for the row count; outside, on torch's default."""
    token = _tables_in_force.set(True)
    try:
        yield
    finally:
        _tables_in_force.reset(token)


class BlasLinear(nn.Linear):
    """nn.Linear (same parameters and state-dict keys) that, inside choices_in_force, runs on the
    BLAS library chosen for its input's row count, where one was chosen; else on torch's
    default."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.blas_by_rows: dict[int, str] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tables = self.blas_by_rows and _tables_in_force.get()
        library = self.blas_by_rows.get(x.shape[0]) if tables else None
        if library is None:
            return F.linear(x, self.weight, self.bias)
        return run_on(library, x, self)


def layers_by_shape(model: nn.Module) -> dict[tuple[int, int], list[BlasLinear]]:
    """The model's BlasLinear layers, grouped by (out_features, in_features)."""
    groups: dict[tuple[int, int], list[BlasLinear]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, BlasLinear):
            groups[(module.out_features, module.in_features)].append(module)
    return dict(groups)


def time_on_gpu(layers: Sequence[BlasLinear], x: torch.Tensor, library: str) -> float:
    """Seconds of one pass of x through every layer on `library`: the median of TIMED_REPS
    replays of the pass captured as a CUDA graph, as decode runs it (launched eagerly, a few-row
    GEMM's time would be the host's launch time), after one eager pass to warm the library up.
    Passing through all of a shape's layers, each with its own weight, reads the weights from
    HBM as a step does instead of from L2."""

    def one_pass() -> None:
        for layer in layers:
            run_on(library, x, layer)

    one_pass()
    torch.cuda.synchronize(x.device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        one_pass()
    graph.replay()  # the first replay uploads the graph
    seconds = []
    for _ in range(TIMED_REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return statistics.median(seconds)


def candidates(layers: Sequence[BlasLinear], x: torch.Tensor) -> tuple[str, ...]:
    """The libraries to time for this group: FlashInfer (after its autotuner has timed its
    algorithms at x's row count) where it takes the layers."""
    if not all(flashinfer_can_run(layer) for layer in layers):
        return TORCH_LIBRARIES
    try:  # one algorithm per shape and row count
        flashinfer_linear(x, layers[0].weight, tune=True)
    except Exception as refusal:  # a shape or GPU this FlashInfer's mm_bf16 refuses: torch's only
        shape = (layers[0].out_features, layers[0].in_features)
        if shape not in _refusals_logged:  # once per shape, not once per batch size
            _refusals_logged.add(shape)
            logger.warning(
                "FlashInfer's mm_bf16 refused the %dx%d projections (torch's libraries only): "
                "%s: %s",
                *shape,
                type(refusal).__name__,
                refusal,
            )
        return TORCH_LIBRARIES
    return LIBRARIES


@torch.inference_mode()
def tune_rows(
    model: nn.Module,
    num_rows: int,
    timer: Timer | None = None,
    libraries: Callable[[Sequence[BlasLinear], torch.Tensor], tuple[str, ...]] = candidates,
) -> dict[str, str]:
    """Time each group of same-shaped projections at num_rows rows on each of its candidate
    libraries and record the fastest in their tables; a group already tuned at num_rows
    (another engine built on the same model) keeps its choice untimed.
    timer (default time_on_gpu) gives a library's seconds for a group. Returns "out x in" -> the
    library chosen, for the log."""
    timer = timer or time_on_gpu
    generator: torch.Generator | None = None
    chosen: dict[str, str] = {}
    for (out_features, in_features), layers in layers_by_shape(model).items():
        if all(num_rows in layer.blas_by_rows for layer in layers):
            chosen[f"{out_features}x{in_features}"] = layers[0].blas_by_rows[num_rows]
            continue
        weight = layers[0].weight
        if generator is None:
            generator = torch.Generator(weight.device).manual_seed(TUNE_SEED)
        x = torch.randn(num_rows, in_features, generator=generator, device=weight.device)
        x = x.to(weight.dtype)
        names = libraries(layers, x)
        seconds = {library: timer(layers, x, library) for library in names}
        best = min(names, key=seconds.__getitem__)  # a tie keeps the default (first)
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
    counts = ", ".join(f"{lib} {picks.count(lib)}" for lib in LIBRARIES if lib in picks)
    largest = max(table)
    at_largest = ", ".join(f"{shape} {library}" for shape, library in table[largest].items())
    return f"{counts} of {len(picks)} (size, shape) pairs; at {largest}: {at_largest}"
