"""Time GEMM candidates on the 8B projections at one row count (graph replays, as
bench.fp8_gemv_bench times them): per-step ms over the 32 layers, TFLOP/s and each candidate's
worst error against the product its operands stand for. Owns no state; needs a GPU."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from bench.fp8_gemv_bench import NUM_LAYERS, SHAPES, graph_us

# label -> (op, the float32 product it stands for)
Candidates = dict[str, tuple[Callable[[], torch.Tensor], torch.Tensor]]


def time_candidates(
    num_rows: int,
    gen: torch.Generator,
    candidates: Callable[[torch.Tensor, torch.Tensor], Candidates],
    tuned: Collection[str] = (),
    tune: Callable[[Callable[[], torch.Tensor], int], None] | None = None,
) -> dict[str, Any]:
    """Per-step ms, TFLOP/s and worst relative error of every candidate at num_rows rows.
    candidates(x bf16 [rows, K], weight float32 [N, K]) gives the ops of one projection; the
    labels in tuned are first passed to tune(op, num_rows). A candidate that raises (a kernel
    this install lacks) is reported and dropped, not fatal."""
    step_ms: dict[str, float] = {}
    errors: dict[str, str] = {}
    worst: dict[str, float] = {}
    flops = 0
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        x = torch.randn(num_rows, k, device="cuda", generator=gen).bfloat16()
        for label, (op, want) in candidates(x, weight).items():
            if label in errors:
                continue
            try:
                if label in tuned and tune is not None:
                    tune(op, num_rows)
                got = op().float()
                rel = float((got - want).abs().max() / want.abs().max())
                us = graph_us(op)
            except Exception as error:
                errors[label] = f"{name}: {type(error).__name__}: {error}"[:800]
                step_ms.pop(label, None)
                print(f"M={num_rows} {label}: {errors[label]}", flush=True)
                continue
            step_ms[label] = step_ms.get(label, 0.0) + us * NUM_LAYERS / 1e3
            worst[label] = max(worst.get(label, 0.0), rel)
            print(
                f"M={num_rows:5d} {name:12s} {label:30s} {us:8.1f} us  rel err {rel:.1e}",
                flush=True,
            )
        flops += 2 * num_rows * n * k * NUM_LAYERS
        del weight, x
    tflops = {label: flops / (ms / 1e3) / 1e12 for label, ms in step_ms.items()}
    return {"rows": num_rows, "step_ms": step_ms, "tflops": tflops, "max_rel": worst} | (
        {"errors": errors} if errors else {}
    )


def tune_exact(op: Callable[[], torch.Tensor], num_rows: int) -> None:
    """Let FlashInfer's autotuner time op's candidate algorithms at exactly num_rows rows (its
    default buckets would tune a larger M and round this one up to it, and a cuBLASLt tactic
    is an index into the algorithm list of the exact M it was tuned at)."""
    from flashinfer.autotuner import autotune

    with autotune(True, tuning_buckets=(num_rows,)):
        op()
    torch.cuda.synchronize()


def print_step(row: dict[str, Any]) -> None:
    """One line per candidate of a time_candidates result."""
    for label, ms in row["step_ms"].items():
        print(
            f"M={row['rows']:5d} {label:30s} {ms:8.2f} ms a step  "
            f"{row['tflops'][label]:6.0f} TFLOP/s  max rel err {row['max_rel'][label]:.1e}",
            flush=True,
        )
