"""The one-row fused bf16 GEMVs (engine/models/fused_gemv.py) alone on the Llama-3.1-8B decoder
layer's four projections, each with its fusion (qkv: RMSNorm; o: residual add; gate/up: RMSNorm
and SiLU; down: residual add), with the engine's tile (tile_for) and once per tile in TILES,
next to cuBLAS's plain product (F.linear, no fusion). Each is timed as a chain of calls over
enough copies of the weight that none is still in L2 when it is read again (the chain replayed
from one CUDA graph, PDL as the engine launches them); the table gives us a call and the weight
bytes read a second. Owns no state; needs a GPU.

    python -m bench.fused_gemv_bench [--rows 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.models import fused_gemv

HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144  # Llama-3.1-8B
EPS = 1e-5
TILES = (  # (BLOCK_N, BLOCK_K, num_warps)
    (2, 1024, 4),
    (4, 1024, 4),
    (4, 2048, 8),
    (8, 512, 4),
    (16, 512, 8),
    (8, 1024, 8),
    (1, 1024, 2),
    (2, 2048, 4),
)
CHAIN_BYTES = 512 << 20  # each chain reads at least this much weight: 10x the H200's L2
REPLAYS = 5


def chain_us(calls: list[Callable[[], Any]]) -> float:
    """Microseconds per call of the chain, replayed REPLAYS times from one CUDA graph."""
    for call in calls[:1]:
        call()  # compile, cuBLAS handles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * len(calls))


def projection_calls(
    name: str, weights: list[torch.Tensor], num_rows: int, tile: tuple[int, int, int] | None
) -> list[Callable[[], Any]]:
    """One fused call per weight copy of projection `name` (tile None: the engine's)."""
    k = weights[0].shape[1]
    x = torch.randn(num_rows, k, device="cuda").bfloat16()
    norm = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    n = weights[0].shape[0] // (2 if name == "gate_up" else 1)
    out = torch.zeros(num_rows, n, device="cuda").bfloat16()
    silu = name == "gate_up"
    normed = name in ("qkv", "gate_up")

    def call(weight: torch.Tensor) -> Callable[[], Any]:
        if normed:
            return lambda: fused_gemv._launch(x, weight, out, n, norm, EPS, silu, tile=tile)
        return lambda: fused_gemv._launch(x, weight, out, n, residual=out, tile=tile)

    return [call(w) for w in weights]


def one_projection(name: str, n_rows: int, k: int, num_rows: int) -> dict[str, Any]:
    size = n_rows * k * 2
    copies = max(2, -(-CHAIN_BYTES // size))
    weights = [torch.randn(n_rows, k, device="cuda").bfloat16() * 0.02 for _ in range(copies)]
    x = torch.randn(num_rows, k, device="cuda").bfloat16()
    result: dict[str, Any] = {"weight_mib": size / 2**20, "copies": copies, "us": {}}

    def record(label: str, calls: list[Callable[[], Any]]) -> None:
        try:
            us = chain_us(calls)
        except Exception as error:  # a tile that does not compile is a result too
            result["us"][label] = f"error: {type(error).__name__}: {str(error)[:120]}"
            return
        result["us"][label] = us
        print(f"  {name:8s} {label:22s} {us:8.2f} us  {size / us / 1e3:7.0f} GB/s", flush=True)

    record("cublas", [lambda w=w: F.linear(x, w) for w in weights])
    record("engine", projection_calls(name, weights, num_rows, None))
    for tile in TILES:
        record("x".join(map(str, tile)), projection_calls(name, weights, num_rows, tile))
    del weights
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    shapes = {
        "qkv": (QKV, HIDDEN),
        "o": (HIDDEN, HIDDEN),
        "gate_up": (2 * INTERMEDIATE, HIDDEN),
        "down": (HIDDEN, INTERMEDIATE),
    }
    results = {"device": torch.cuda.get_device_name(), "rows": args.rows, "projections": {}}
    for name, (n_rows, k) in shapes.items():
        print(f"{name}: [{n_rows}, {k}]", flush=True)
        results["projections"][name] = one_projection(name, n_rows, k, args.rows)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
