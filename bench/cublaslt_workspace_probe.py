"""Does cuBLASLt's workspace size change the per-tensor FP8 GEMMs of a decode step? Times the
engine's deferred-scale product (torch._scaled_mm, unit scales, fast accumulation) on the 8B
projections at decode batch sizes inside one CUDA graph of 32 layers, and lists the graph's
kernels and memsets by name with their GPU time. Run it once per setting of torch's
CUBLASLT_WORKSPACE_SIZE (KiB) / CUBLAS_WORKSPACE_CONFIG to compare. Owns no state; needs an
FP8-capable GPU.

    CUBLASLT_WORKSPACE_SIZE=0 python -m bench.cublaslt_workspace_probe [--rows 768 232]
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

import torch

from bench.fp8_gemv_bench import NUM_LAYERS, SHAPES
from bench.lib.gpu_timing import event_ms
from engine.quant.fp8 import FP8_DTYPE

REPLAYS = 20


def graph_of_step(rows: int) -> tuple[torch.cuda.CUDAGraph, int]:
    """One graph of NUM_LAYERS x the projections' per-tensor FP8 GEMMs at rows rows."""
    unit = torch.ones((), device="cuda")
    operands = []
    for n, k in SHAPES.values():
        x = torch.randn(rows, k, device="cuda").to(FP8_DTYPE)
        w = torch.randn(n, k, device="cuda").to(FP8_DTYPE)
        operands.append((x, w))

    def step() -> None:
        for _ in range(NUM_LAYERS):
            for x, w in operands:
                torch._scaled_mm(
                    x, w.t(), scale_a=unit, scale_b=unit, out_dtype=torch.bfloat16,
                    use_fast_accum=True,
                )  # fmt: skip

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph, NUM_LAYERS * len(operands)


def measure(rows: int) -> dict[str, object]:
    """Replay ms of the graph and its kernels by name (GPU us a step, count a step)."""
    from torch.profiler import ProfilerActivity, profile

    graph, gemms = graph_of_step(rows)
    for _ in range(2):
        graph.replay()
    step_ms = event_ms(graph.replay, REPLAYS)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_name[event.name[:90]][0] += event.device_time / 3
            by_name[event.name[:90]][1] += 1 / 3
    kernels = sorted(by_name.items(), key=lambda item: -item[1][0])
    return {
        "rows": rows,
        "gemms": gemms,
        "replay_ms": step_ms,
        "kernels": [{"name": n, "us": round(t, 1), "count": round(c)} for n, (t, c) in kernels],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[768, 232])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    settings = {
        k: os.environ.get(k) for k in ("CUBLASLT_WORKSPACE_SIZE", "CUBLAS_WORKSPACE_CONFIG")
    }
    results = [measure(rows) for rows in args.rows]
    for result in results:
        print(f"{settings} rows {result['rows']}: replay {result['replay_ms']:.3f} ms")
        for kernel in result["kernels"][:8]:
            print(f"  {kernel['us']:9.1f} us x{kernel['count']:4d}  {kernel['name']}")
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=1))


if __name__ == "__main__":
    main()
