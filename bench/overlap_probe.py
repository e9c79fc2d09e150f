"""Can a decode step's attention and GEMMs share the GPU? A probe on the 8B shape: 32 layers of
a decode step's four projections and its attention over a paged cache, run as one batch, as
two half batches one after the other, and as two half batches on two streams (free-running,
or in lockstep: one half's attention beside the other half's GEMMs), with and without an SM
carve-out for the GEMMs (torch._C._set_sm_carveout_experimental, which cuBLASLt takes as
CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET). Also the GEMMs alone at several row counts (tile
quantization of the batch). Owns no state; eager launches timed with CUDA events (the kernels
here are long enough to keep the host ahead). Needs a Hopper GPU with FlashInfer.

    python -m bench.overlap_probe [--rows bf16=384 fp8kv=704 fp8w=768] [--context 1500]
        [--carveouts 0 16 32 48] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, PAGE = 4096, 32, 8, 128, 14336, 32, 16
PROJECTIONS = {"qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o": (HIDDEN, HIDDEN)}
PROJECTIONS |= {"gate_up": (HIDDEN, 2 * FFN), "down": (FFN, HIDDEN)}
FP8 = torch.float8_e4m3fn


class Gemms:
    """One layer's four projections (reused for every layer: each weight is far larger than
    L2), bf16 or e4m3 with per-tensor scales, applied to a rows-long slice of the inputs."""

    def __init__(self, fp8: bool, max_rows: int, device: torch.device):
        self.fp8 = fp8
        dtype = FP8 if fp8 else torch.bfloat16
        self.weights = {
            name: (torch.randn(n, k, device=device) * 0.02).to(dtype)
            for name, (k, n) in PROJECTIONS.items()
        }
        self.inputs = {
            name: (torch.randn(max_rows, k, device=device)).to(dtype)
            for name, (k, n) in PROJECTIONS.items()
        }
        self.scale = torch.ones((), device=device)

    def one(self, name: str, rows: slice) -> torch.Tensor:
        x, w = self.inputs[name][rows], self.weights[name]
        if self.fp8:
            return torch._scaled_mm(
                x, w.t(), self.scale, self.scale, out_dtype=torch.bfloat16, use_fast_accum=True
            )
        return x @ w.t()

    def after_attention(self, rows: slice) -> None:
        for name in ("o", "gate_up", "down", "qkv"):
            self.one(name, rows)


class Attention:
    """Decode attention of a half (or the whole) batch over one layer's paged cache: XQA for
    an fp8 cache (as the engine), FlashInfer's tensor-core decode for bf16. Each instance has
    its own workspace, so two can run at once."""

    def __init__(self, cache: torch.Tensor, rows: int, context: int, first_row: int):
        import flashinfer

        from engine.attention.base import SeqSpan
        from engine.attention.xqa_decode import XqaDecode

        device = cache.device
        self.cache = cache
        pages = -(-context // PAGE)
        block_ids = [[(first_row + r) * pages + p for p in range(pages)] for r in range(rows)]
        self.q = torch.randn(rows, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)
        self.xqa = None
        if cache.dtype == FP8:
            self.xqa = XqaDecode(HEAD_DIM, PAGE, device, [(1.0, 1.0)] * LAYERS)
            self.xqa.plan([SeqSpan(r, 1, context, ids) for r, ids in enumerate(block_ids)])
            return
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "HND", use_tensor_cores=True, backend="fa2"
        )
        indptr = torch.arange(0, (rows + 1) * pages, pages, dtype=torch.int32, device=device)
        first = first_row * pages  # each row's pages are contiguous, rows one after another
        indices = torch.arange(first, first + rows * pages, dtype=torch.int32, device=device)
        last = torch.full((rows,), context - (pages - 1) * PAGE, dtype=torch.int32, device=device)
        self.wrapper.plan(
            indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, PAGE,
            sm_scale=HEAD_DIM**-0.5, q_data_type=torch.bfloat16, kv_data_type=cache.dtype,
        )  # fmt: skip

    def run(self) -> None:
        if self.xqa is not None:
            self.xqa.run(0, self.q, self.cache, self.out)
        else:
            self.wrapper.run(self.q, self.cache, out=self.out)


def timed_ms(step: Callable[[], None], reps: int = 5) -> float:
    """Mean ms of step over reps after a warm-up, the whole device synchronized around it."""
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def probe_row(name: str, rows: int, context: int, carveouts: list[int]) -> dict[str, float]:
    device = torch.device("cuda")
    fp8_weights, fp8_cache = name == "fp8w", name in ("fp8w", "fp8kv")
    half = rows // 2
    pages = -(-context // PAGE) * rows
    cache = torch.randn(pages, 2, KV_HEADS, PAGE, HEAD_DIM, device=device, dtype=torch.bfloat16)
    if fp8_cache:
        cache = cache.to(FP8)
    gemms = Gemms(fp8_weights, rows, device)
    whole = Attention(cache, rows, context, 0)
    halves = (Attention(cache, half, context, 0), Attention(cache, rows - half, context, half))
    spans = (slice(0, half), slice(half, rows))
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    main = torch.cuda.current_stream()

    def sequential() -> None:
        for _ in range(LAYERS):
            whole.run()
            gemms.after_attention(slice(0, rows))

    def halves_in_turn() -> None:
        for _ in range(LAYERS):
            for attention, span in zip(halves, spans, strict=True):
                attention.run()
                gemms.after_attention(span)

    def free_running() -> None:
        for stream in streams:
            stream.wait_stream(main)
        for stream, attention, span in zip(streams, halves, spans, strict=True):
            with torch.cuda.stream(stream):
                for _ in range(LAYERS):
                    attention.run()
                    gemms.after_attention(span)
        for stream in streams:
            main.wait_stream(stream)

    def lockstep() -> None:
        # stream 0 attends one half while stream 1 runs the other half's GEMMs, then swap
        a, b = streams
        a.wait_stream(main)
        b.wait_stream(main)
        for _ in range(LAYERS):
            for first, second in ((0, 1), (1, 0)):
                with torch.cuda.stream(a):
                    halves[first].run()
                with torch.cuda.stream(b):
                    gemms.after_attention(spans[second])
                a.wait_stream(b)
                b.wait_stream(a)
        main.wait_stream(a)
        main.wait_stream(b)

    result: dict[str, float] = {}
    result["attention_only"] = timed_ms(lambda: [whole.run() for _ in range(LAYERS)])
    result["gemms_only"] = timed_ms(
        lambda: [gemms.after_attention(slice(0, rows)) for _ in range(LAYERS)]
    )
    result["sequential"] = timed_ms(sequential)
    result["halves_in_turn"] = timed_ms(halves_in_turn)
    for carveout in carveouts:
        torch._C._set_sm_carveout_experimental(carveout or None)
        try:
            result[f"gemms_only_carveout{carveout}"] = timed_ms(
                lambda: [gemms.after_attention(slice(0, rows)) for _ in range(LAYERS)]
            )
            result[f"free_running_carveout{carveout}"] = timed_ms(free_running)
            result[f"lockstep_carveout{carveout}"] = timed_ms(lockstep)
        finally:
            torch._C._set_sm_carveout_experimental(None)
    return {k: round(v, 3) for k, v in result.items()}


def gemm_rows_sweep(fp8: bool, row_counts: list[int]) -> dict[int, float]:
    """32 layers of the four projections at each row count: ms, and ms per 1,000 rows."""
    gemms = Gemms(fp8, max(row_counts), torch.device("cuda"))
    return {
        rows: round(
            timed_ms(lambda r=rows: [gemms.after_attention(slice(0, r)) for _ in range(LAYERS)]),
            3,
        )
        for rows in row_counts
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["bf16=384", "fp8kv=704", "fp8w=768"])
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--carveouts", type=int, nargs="+", default=[0, 16, 32, 48])
    parser.add_argument(
        "--sweep", type=int, nargs="+", default=[232, 296, 384, 512, 640, 704, 768, 832]
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "context": args.context}
    started = time.monotonic()
    for spec in args.rows:
        name, rows = spec.split("=")
        try:
            report[spec] = probe_row(name, int(rows), args.context, args.carveouts)
        except Exception as error:  # one row's failure must not lose the others
            report[spec] = {"error": repr(error)}
        print(spec, json.dumps(report[spec]), f"({time.monotonic() - started:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    for fp8 in (False, True):
        key = f"gemm_rows_{'fp8' if fp8 else 'bf16'}"
        try:
            report[key] = gemm_rows_sweep(fp8, args.sweep)
        except Exception as error:
            report[key] = {"error": repr(error)}
        print(key, json.dumps(report[key]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
