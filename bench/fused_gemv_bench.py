"""Few-row projections alone on the Llama-3.1-8B decoder layer's shapes, as a decode step chains
them. bf16: the fused GEMVs (engine/models/fused_gemv.py) with their fusions (qkv: RMSNorm; o:
residual add; gate/up: RMSNorm and SiLU, and once without SiLU, as one 28,672-channel GEMV;
down: residual add), with the engine's tile and once per tile in TILES, next to cuBLAS
(F.linear, no fusion; for gate/up also with KVRELAY_GATE_UP_BLAS's SiLU kernel after it), then
bench/lib/gemv_candidates.py's variants (the sum at each K step, gate/up rows interleaved by
blocks, down forming the SiLU as it reads gate/up's output).
--fp8: the FP8 weights' kernels instead: fp8_dot_rows over quantized rows
(engine/quant/fp8_dot_rows.py) with the engine's tile and once per tile of its autotuner's
list and of FP8_DEEP_TILES, and fp8_gemv (bf16 rows, o_proj's) as autotuned; for one row also
the engine's whole path to each projection's output (its input's quantizing kernel included)
against engine/quant/fp8_one_row.py's GEMV that quantizes its input itself
(KVRELAY_FP8_ONE_ROW); the narrow projections (qkv, o, down) also with K split in FP8_SPLITS
parts (KVRELAY_FP8_SPLIT_K). Each is timed as a chain of calls over enough copies of the weight
that none is still in L2 when it is read again (the chain replayed from one CUDA graph, PDL as
the engine launches them); the table gives us a call and the weight bytes read a second. Owns
no state; needs a GPU.

    python -m bench.fused_gemv_bench [--rows 1] [--fp8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.lib.gemv_candidates import candidate_gemv, interleave
from bench.lib.gpu_timing import chain_us
from engine.models import fused_gemv
from engine.quant.fp8 import Fp8Weight, quantize_rows, quantize_weight
from engine.quant.fp8_dot_rows import WIDE_CHANNELS, fp8_dot_rows, tile_configs, tile_for
from engine.quant.fp8_fused import add_rms_norm_quantize, silu_and_mul_quantize
from engine.quant.fp8_gemv import fp8_gemv
from engine.quant.fp8_one_row import row_dot
from engine.quant.fp8_one_row import tile_for as one_row_tile

HIDDEN, INTERMEDIATE, QKV = 4096, 14336, 6144  # Llama-3.1-8B
EPS = 1e-5
SHAPES = {  # name -> (weight rows, K, RMSNorm before, SiLU after)
    "qkv": (QKV, HIDDEN, True, False),
    "o": (HIDDEN, HIDDEN, False, False),
    "gate_up": (2 * INTERMEDIATE, HIDDEN, True, True),
    "gate_up_nosilu": (2 * INTERMEDIATE, HIDDEN, True, False),
    "down": (HIDDEN, INTERMEDIATE, False, False),
}
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
CANDIDATE_TILES = ((4, 1024, 4), (8, 512, 4), (2, 1024, 4))  # the engine's and close ones
# (BLOCK_N, BLOCK_K, warps, stages). Beyond the autotuner's list: more bytes in flight a program
# (stages x BLOCK_N x BLOCK_K), for the narrow projections (qkv, o, down), whose 32-channel
# tiles leave 128-192 programs for 132 SMs and read their weights at ~2.4 TB/s.
FP8_DEEP_TILES = ((16, 1024, 4, 4), (16, 512, 4, 6), (32, 512, 4, 5), (32, 256, 4, 6))
FP8_ONE_ROW_TILES = (
    (32, 512, 4, 3),
    (64, 256, 4, 3),
    (32, 256, 4, 3),
    (16, 512, 4, 3),
    (32, 256, 4, 4),
    *FP8_DEEP_TILES,
)
# K's parts (engine/quant/split_k.py) the narrow FP8 projections are timed at, on the engine's
# tile: more programs than their 128-192 tiles, each over part of K
FP8_SPLITS = (2, 3, 4, 6, 8)
CHAIN_BYTES = 512 << 20  # each chain reads at least this much weight: 10x the H200's L2
Calls = list[Callable[[], Any]]


def recorder(name: str, weight_bytes: int, result: dict[str, Any]) -> Callable[[str, Calls], None]:
    """record(label, calls): time the chain into result["us"][label] and print a row."""

    def record(label: str, calls: Calls) -> None:
        try:
            us = chain_us(calls)
        except Exception as error:  # a tile that does not compile is a result too
            result["us"][label] = f"error: {type(error).__name__}: {str(error)[:120]}"
            print(f"  {name:15s} {label:16s} {result['us'][label]}", flush=True)
            return
        result["us"][label] = us
        rate = weight_bytes / us / 1e3
        print(f"  {name:15s} {label:16s} {us:8.2f} us  {rate:7.0f} GB/s", flush=True)

    return record


def operands(
    name: str, weights: list[torch.Tensor], num_rows: int, silu_input: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, int, torch.Tensor]:
    """A call's input (gate/up's plain output, twice as wide, with silu_input), the norm's
    weight (None: projection `name` has no norm before it, its output is added in place), the
    output channels and the output."""
    _, k, normed, silu = SHAPES[name]
    x = torch.randn(num_rows, (2 if silu_input else 1) * k, device="cuda").bfloat16()
    norm = (torch.rand(k, device="cuda") + 0.5).bfloat16() if normed else None
    n = weights[0].shape[0] // (2 if silu else 1)
    return x, norm, n, torch.zeros(num_rows, n, device="cuda").bfloat16()


def bf16_calls(
    name: str, weights: list[torch.Tensor], num_rows: int, tile: tuple[int, int, int] | None
) -> Calls:
    """One fused call per weight copy of projection `name` (tile None: the engine's)."""
    x, norm, n, out = operands(name, weights, num_rows)
    silu = SHAPES[name][3]

    def call(weight: torch.Tensor) -> Callable[[], Any]:
        if norm is not None:
            return lambda: fused_gemv._launch(x, weight, out, n, norm, EPS, silu, tile=tile)
        return lambda: fused_gemv._launch(x, weight, out, n, residual=out, tile=tile)

    return [call(w) for w in weights]


def candidate_calls(
    name: str,
    weights: list[torch.Tensor],
    num_rows: int,
    tile: tuple[int, int, int],
    **switch: bool,
) -> Calls:
    """One call of bench/lib/gemv_candidates.py's kernel per weight copy, with its fusions
    and the given switches."""
    x, norm, _, out = operands(name, weights, num_rows, switch.get("silu_input", False))
    fusions = {"norm": norm, "eps": EPS, "silu": SHAPES[name][3], "add": norm is None}
    return [lambda w=w: candidate_gemv(x, w, out, tile, **fusions, **switch) for w in weights]


def time_candidates(
    name: str, weights: list[torch.Tensor], num_rows: int, record: Callable[[str, Calls], None]
) -> None:
    """Each CANDIDATE_TILES tile with its products summed at each K step; gate/up from
    weights interleaved by blocks (both ways of summing); down forming the SiLU from gate/up's
    plain output as it reads it."""
    for tile in CANDIDATE_TILES:
        label = "x".join(map(str, tile))
        record(f"{label} sum", candidate_calls(name, weights, num_rows, tile, sum_each_step=True))
        if name == "gate_up":
            mixed = [interleave(w, tile[0]) for w in weights]
            for each in (False, True):
                calls = candidate_calls(
                    name, mixed, num_rows, tile, interleaved=True, sum_each_step=each
                )
                record(f"{label} inter{' sum' if each else ''}", calls)
            mixed.clear()
        if name == "down":
            calls = candidate_calls(name, weights, num_rows, tile, silu_input=True)
            record(f"{label} silu-in", calls)


def copies_of(weight_bytes: int) -> int:
    return max(2, -(-CHAIN_BYTES // weight_bytes))


def one_bf16(name: str, num_rows: int) -> dict[str, Any]:
    n_rows, k, _, _ = SHAPES[name]
    size = n_rows * k * 2
    weights = [
        torch.randn(n_rows, k, device="cuda").bfloat16() * 0.02 for _ in range(copies_of(size))
    ]
    x = torch.randn(num_rows, k, device="cuda").bfloat16()
    result: dict[str, Any] = {"weight_mib": size / 2**20, "copies": len(weights), "us": {}}
    record = recorder(name, size, result)
    record("cublas", [lambda w=w: F.linear(x, w) for w in weights])
    record("engine", bf16_calls(name, weights, num_rows, None))
    if name == "gate_up":  # KVRELAY_GATE_UP_BLAS=1: cuBLAS, then 1/rms and the SiLU
        calls = [lambda w=w: fused_gemv.silu_and_mul_rms(F.linear(x, w), x, EPS) for w in weights]
        record("cublas+silu_rms", calls)
    for tile in TILES:
        record("x".join(map(str, tile)), bf16_calls(name, weights, num_rows, tile))
    time_candidates(name, weights, num_rows, record)
    weights.clear()
    torch.cuda.empty_cache()
    return result


def time_fp8_one_row(
    name: str, weights: list[Fp8Weight], record: Callable[[str, Calls], None]
) -> None:
    """One row: the engine's whole path to this projection's output ("path": the kernel that
    quantizes its input, then fp8_dot_rows; o_proj: fp8_gemv) against
    engine/quant/fp8_one_row.py's GEMV (KVRELAY_FP8_ONE_ROW), which quantizes its input itself
    and takes the norm (qkv, gate/up), the SiLU (gate/up) and the residual add (o, down) in,
    once per tile in FP8_ONE_ROW_TILES (the engine's: fp8_dot_rows.tile_for of the output's
    width)."""
    _, k, normed, silu = SHAPES[name]
    x = torch.randn(1, k, device="cuda").bfloat16()
    norm = (torch.rand(k, device="cuda") + 0.5).bfloat16() if normed else None
    if name == "o":
        engine = [lambda w=w: fp8_gemv(x, w.weight, w.scale, None) for w in weights]
    else:
        if normed:
            residual = torch.randn_like(x)
            quantize = lambda: add_rms_norm_quantize(x, residual, norm, EPS, None)  # noqa: E731
        else:  # down: its input is gate/up's product, made into silu(gate) * up and quantized
            gate_up = torch.randn(1, 2 * k, device="cuda").bfloat16()
            quantize = lambda: silu_and_mul_quantize(gate_up, None)  # noqa: E731
        engine = [lambda w=w: fp8_dot_rows(*quantize(), w.weight, w.scale, None) for w in weights]
    record("path", engine)
    n = weights[0].weight.shape[0] // (2 if silu else 1)
    out = torch.zeros(1, n, device="cuda").bfloat16()
    fusions = {"norm": norm, "eps": EPS, "silu": silu, "add": not normed}
    for tile in FP8_ONE_ROW_TILES:
        calls = [
            lambda w=w, tile=tile: row_dot(x, w.weight, w.scale, out, tile, **fusions)
            for w in weights
        ]
        record("one_row " + "x".join(map(str, tile)), calls)
    if silu:
        return
    tile = one_row_tile(n, silu)
    for parts in FP8_SPLITS:
        calls = [
            lambda w=w, parts=parts: row_dot(
                x, w.weight, w.scale, out, tile, split_k=parts, **fusions
            )
            for w in weights
        ]
        record(f"one_row split {parts}", calls)


def one_fp8(name: str, num_rows: int) -> dict[str, Any]:
    n_rows, k, _, _ = SHAPES[name]
    size = n_rows * k
    weights = [
        quantize_weight(torch.randn(n_rows, k, device="cuda") * 0.02)
        for _ in range(copies_of(size))
    ]
    x = torch.randn(num_rows, k, device="cuda").bfloat16()
    q, scale = quantize_rows(x, None)
    result: dict[str, Any] = {"weight_mib": size / 2**20, "copies": len(weights), "us": {}}
    record = recorder(name, size, result)

    def dot_rows(tile: tuple[int, ...] | None) -> Calls:
        return [lambda w=w: fp8_dot_rows(q, scale, w.weight, w.scale, None, tile) for w in weights]

    record("dot_rows", dot_rows(None))
    if n_rows < WIDE_CHANNELS:  # the narrow ones: split K on the engine's tile
        for parts in FP8_SPLITS:
            record(f"dot_rows split {parts}", [
                lambda w=w, parts=parts: fp8_dot_rows(
                    q, scale, w.weight, w.scale, None, tile_for(n_rows), parts
                )
                for w in weights
            ])  # fmt: skip
    listed = [
        (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages)
        for c in tile_configs()
    ]
    for tile in (*listed, *FP8_DEEP_TILES):
        record("x".join(map(str, tile)), dot_rows(tile))
    record("gemv", [lambda w=w: fp8_gemv(x, w.weight, w.scale, None) for w in weights])
    if num_rows == 1:
        time_fp8_one_row(name, weights, record)
    weights.clear()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--fp8", action="store_true", help="the FP8 weights' kernels")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "rows": args.rows, "projections": {}}
    for name, (n_rows, k, _, _) in SHAPES.items():
        if args.fp8 and name == "gate_up_nosilu":
            continue  # the FP8 kernels have no SiLU inside
        print(f"{name}: [{n_rows}, {k}]", flush=True)
        one = one_fp8 if args.fp8 else one_bf16
        results["projections"][name] = one(name, args.rows)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
