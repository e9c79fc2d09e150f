"""Can a decode step's attention and GEMMs share the GPU? A probe on the 8B shape: 32 layers of
a decode step's four projections and its attention over a paged cache, run as one batch, as
two half batches one after the other, and as two half batches on two streams (free-running,
launched layer by layer on both, or in lockstep: one half's attention beside the other half's
GEMMs, or pipelined through events: one stream attends, the other multiplies), on torch's
default BLAS and on cuBLASLt with and without an SM carve-out for the GEMMs
(torch._C._set_sm_carveout_experimental, which torch passes only to cuBLASLt, as
CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET; its default bf16 path, cuBLAS, ignores it), and with
the attention confined to some SMs by a CUDA green context and the GEMMs carved out of the
rest. Also the GEMMs alone at several row counts (tile quantization of the batch). Owns no
state; eager launches timed with CUDA events (the kernels here are long enough to keep the host
ahead; each figure is the median of SAMPLES). Needs a Hopper GPU with FlashInfer.

    python -m bench.overlap_probe [--rows bf16=384 fp8kv=704 fp8w=768] [--context 1500]
        [--carveouts 0 16 32 48] [--green-sms 32 48 66] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from bench.fp8_gemv_bench import NUM_LAYERS as LAYERS
from bench.fp8_gemv_bench import SHAPES  # the 8B projections: name -> (N, K)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
FP8 = torch.float8_e4m3fn
AFTER_ATTENTION = ("o_proj", "gate_up_proj", "down_proj", "qkv_proj")  # a layer's order


class Gemms:
    """One layer's four projections (reused for every layer: each weight is far larger than
    L2), bf16 or e4m3 with per-tensor scales, applied to a rows-long slice of the inputs."""

    def __init__(self, fp8: bool, max_rows: int, device: torch.device):
        self.fp8 = fp8
        dtype = FP8 if fp8 else torch.bfloat16
        self.weights = {
            name: (torch.randn(n, k, device=device) * 0.02).to(dtype)
            for name, (n, k) in SHAPES.items()
        }
        self.inputs = {
            name: (torch.randn(max_rows, k, device=device)).to(dtype)
            for name, (n, k) in SHAPES.items()
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
        for name in AFTER_ATTENTION:
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


SAMPLES = 5  # timed samples of REPS steps each; a figure is their median
REPS = 3


def timed_ms(step: Callable[[], None]) -> float:
    """Median over SAMPLES of the mean ms of REPS steps, after a warm-up, the whole device
    synchronized around each sample."""
    step()
    torch.cuda.synchronize()
    samples = []
    for _ in range(SAMPLES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPS):
            step()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / REPS)
    return statistics.median(samples)


def probe_row(
    name: str, rows: int, context: int, carveouts: list[int], green_sms: list[int], base: bool
) -> dict[str, float | str]:
    """One row's figures (ms a step): with base, the whole batch and the halves on the default
    BLAS, then each carve-out on cuBLASLt, then each green-context split."""
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
        # each half on its own stream, no joins between layers; launched layer by layer on
        # both so that neither stream starts a whole step's launches behind the other
        for stream in streams:
            stream.wait_stream(main)
        for _ in range(LAYERS):
            for stream, attention, span in zip(streams, halves, spans, strict=True):
                with torch.cuda.stream(stream):
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

    def pipelined(attn_stream: torch.cuda.Stream, gemm_stream: torch.cuda.Stream) -> Callable:
        """The halves through a two-stage pipeline joined by events: attention on attn_stream,
        GEMMs on gemm_stream, so one half's GEMMs can run beside the other half's attention."""

        def step() -> None:
            attn_stream.wait_stream(main)
            gemm_stream.wait_stream(main)
            gemms_done: list[torch.cuda.Event | None] = [None, None]
            for _ in range(LAYERS):
                for h in (0, 1):
                    if gemms_done[h] is not None:
                        attn_stream.wait_event(gemms_done[h])
                    with torch.cuda.stream(attn_stream):
                        halves[h].run()
                    gemm_stream.wait_event(attn_stream.record_event())
                    with torch.cuda.stream(gemm_stream):
                        gemms.after_attention(spans[h])
                    gemms_done[h] = gemm_stream.record_event()
            main.wait_stream(attn_stream)
            main.wait_stream(gemm_stream)

        return step

    result: dict[str, float | str] = {}
    if base:
        result["attention_only"] = timed_ms(lambda: [whole.run() for _ in range(LAYERS)])
        result["gemms_only"] = timed_ms(
            lambda: [gemms.after_attention(slice(0, rows)) for _ in range(LAYERS)]
        )
        result["sequential"] = timed_ms(sequential)
        result["halves_in_turn"] = timed_ms(halves_in_turn)
        result["pipelined"] = timed_ms(pipelined(*streams))
    default_blas = torch.backends.cuda.preferred_blas_library()
    for carveout in carveouts:  # on cuBLASLt, the library that takes the carve-out
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(carveout or None)
        try:
            result[f"cublaslt_carveout{carveout}_gemms_only"] = timed_ms(
                lambda: [gemms.after_attention(slice(0, rows)) for _ in range(LAYERS)]
            )
            result[f"cublaslt_carveout{carveout}_free_running"] = timed_ms(free_running)
            result[f"cublaslt_carveout{carveout}_lockstep"] = timed_ms(lockstep)
            result[f"cublaslt_carveout{carveout}_pipelined"] = timed_ms(pipelined(*streams))
        finally:
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library(default_blas)
    for sms in green_sms:  # attention confined to sms SMs (a green context), GEMMs carved out
        try:
            green = torch.cuda.green_contexts.GreenContext.create(
                num_sms=sms, device_id=torch.cuda.current_device()
            )
            green_stream = green.Stream()
        except Exception as error:  # a torch or driver without green contexts
            result["green_error"] = repr(error)
            break

        def attention_on_green(stream: torch.cuda.Stream = green_stream) -> None:
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                for _ in range(LAYERS):
                    whole.run()
            main.wait_stream(stream)

        result[f"green{sms}_attention_only"] = timed_ms(attention_on_green)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(sms)
        try:
            result[f"green{sms}_pipelined"] = timed_ms(pipelined(green_stream, streams[1]))
        finally:
            torch._C._set_sm_carveout_experimental(None)
            torch.backends.cuda.preferred_blas_library(default_blas)
    return {k: v if isinstance(v, str) else round(v, 3) for k, v in result.items()}


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
        "--green-sms", type=int, nargs="*", default=[32, 48, 66], help="attention's SMs"
    )
    parser.add_argument(
        "--sweep", type=int, nargs="+", default=[232, 296, 384, 512, 640, 704, 768, 832]
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "context": args.context}
    started = time.monotonic()

    def record(key: str, measure: Callable[[], object]) -> None:
        """One part of the report, written to disk as soon as it is measured, so that a part
        that fails or hangs leaves the earlier ones (the green-context parts, which run kernels
        on fewer SMs than they size their grids for, come last)."""
        try:
            report[key] = measure()
        except Exception as error:
            report[key] = {"error": repr(error)}
        print(key, json.dumps(report[key]), f"({time.monotonic() - started:.0f} s)", flush=True)
        torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    for fp8 in (False, True):
        record(
            f"gemm_rows_{'fp8' if fp8 else 'bf16'}", lambda f=fp8: gemm_rows_sweep(f, args.sweep)
        )
    for spec in args.rows:
        name, rows = spec.split("=")
        record(
            spec,
            lambda n=name, r=int(rows): probe_row(n, r, args.context, args.carveouts, [], True),
        )
    for spec in args.rows if args.green_sms else []:
        name, rows = spec.split("=")
        record(
            f"{spec} green",
            lambda n=name, r=int(rows): probe_row(n, r, args.context, [], args.green_sms, False),
        )


if __name__ == "__main__":
    main()
