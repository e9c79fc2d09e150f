"""While attention runs in a step of few rows, a side stream asks L2 for the o_proj weight that
comes next; owns the side stream of each device and the byte budget read once from the
environment (imports triton on first use).

Why: a batch-1 decode step is bound by reading the weights, except inside attention (RoPE, the
paged decode kernel and its merge: ~10 us a layer of the 8B shape on an H200), which reads a
few MiB of KV and leaves HBM idle. Prefetching o_proj's weight (32 MiB in bf16, 16 in e4m3; the
H200's L2 holds 50) in that window lets o_proj's GEMV read it from L2. The prefetch kernel is
forked after qkv_proj, so it does not compete with a GEMV for HBM, and joined before o_proj;
under CUDA graph capture the fork and join become two branches of the graph. It only reads
(PTX prefetch.global.L2), so no result depends on it.

KVRELAY_ATTN_PREFETCH_MIB: at most this many MiB of o_proj's weight (its first bytes) are
prefetched (default PREFETCH_MIB_DEFAULT; 0: none, no side stream). Steps of more than
MAX_ROWS rows never prefetch: their attention reads enough KV to keep HBM busy.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

ENV = "KVRELAY_ATTN_PREFETCH_MIB"
PREFETCH_MIB_DEFAULT = 32
MAX_MIB = 1024
MAX_ROWS = 2
LINE_BYTES = 128  # one prefetch asks for one L2 line
LANES = 128  # prefetches a program issues at a time (one a thread, 4 warps)


@functools.cache
def budget_bytes() -> int:
    """The most bytes of a weight prefetched (read once; cache_clear to re-read); a value
    that is not a whole number of MiB in 0..MAX_MIB is refused by the variable's name."""
    raw = os.environ.get(ENV, str(PREFETCH_MIB_DEFAULT)).strip()
    if not raw.isdecimal() or int(raw) > MAX_MIB:
        raise ValueError(f"{ENV} must be a whole number of MiB, 0..{MAX_MIB}, got {raw!r}")
    return int(raw) << 20


def applies(weight: torch.Tensor, num_rows: int) -> bool:
    """Whether a step of num_rows rows prefetches weight during attention: a CUDA weight,
    few rows, a budget above 0."""
    return weight.is_cuda and 0 < num_rows <= MAX_ROWS and budget_bytes() > 0


def during(weight: torch.Tensor, num_rows: int, work: Callable[[], torch.Tensor]) -> torch.Tensor:
    """work()'s result; where applies(weight, num_rows), the first budget_bytes() of weight are
    prefetched into L2 on a side stream while work's kernels run on the current one, which
    waits for the prefetch before anything after this call."""
    if not applies(weight, num_rows):
        return work()
    main = torch.cuda.current_stream(weight.device)
    side = _side_stream(weight.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        prefetch(weight, budget_bytes())
    result = work()
    main.wait_stream(side)
    return result


def prefetch(weight: torch.Tensor, max_bytes: int) -> int:
    """Ask L2 for the first min(max_bytes, weight's bytes) of a contiguous CUDA weight, in
    whole lines, on the current stream; returns the number of lines asked for."""
    if not weight.is_contiguous():
        raise ValueError("only a contiguous weight can be prefetched")
    num_lines = min(max_bytes, weight.numel() * weight.element_size()) // LINE_BYTES
    if num_lines == 0:
        return 0
    programs = min(_programs(weight.device), -(-num_lines // LANES))
    lines_per_program = -(-num_lines // programs)
    _kernel()[(programs,)](weight, num_lines, lines_per_program, LANES=LANES, num_warps=4)
    return num_lines


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@functools.cache
def _programs(device: torch.device) -> int:
    """One program an SM: attention's few programs find room beside them."""
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_lines(w_ptr, num_lines, lines_per_program, LANES: tl.constexpr):
        """Program p asks L2 for lines [p * lines_per_program, ...) of w, LANES at a time."""
        base = w_ptr.to(tl.pointer_type(tl.int8))
        first = tl.program_id(0) * lines_per_program
        last = tl.minimum(first + lines_per_program, num_lines) - 1
        lanes = tl.arange(0, LANES)
        for offset in range(0, lines_per_program, LANES):
            line = tl.minimum(first + offset + lanes, last).to(tl.int64)
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; // $0",
                "=r,l",
                [base + line * 128],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )

    return prefetch_lines
