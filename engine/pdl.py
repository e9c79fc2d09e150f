"""Programmatic dependent launch (PDL) for the engine's Triton kernels on Hopper and newer:
whether they launch with it, and the Triton helper that can stream a GEMM's weights into L2
before it waits; owns no state but the settings read once from the environment (imports triton
on first use).

A kernel launched with PDL may become resident while the kernel before it on the stream still
runs, once every program of that one has called `gdc_launch_dependents` (or exited). It must
then call `gdc_wait` (which returns when the kernel before has finished and its writes are
visible) before it reads anything an earlier kernel wrote and before it writes anything. Since
each PDL kernel finishes only after its own wait, the stream's order holds through a chain of
them. What may run before the wait is only what reads no earlier kernel's output: here, L2
prefetches of the weights.

Where it pays: a decode step of one or a few sequences is ~300 small kernels, each bound by
its latency or by its weight reads. With PDL a kernel's launch and start overlap the end of
the one before: the norm, RoPE and SiLU kernels (and FlashInfer's XQA, which does the same) let
the next one in at their start, the few-row GEMMs (fp8_dot_rows, fp8_gemv) after their main
loop. On an H200 the 8B shape's batch-1 FP8 graph replay went from 3.03 to 2.75 ms
(bench/RESULTS.md). The GEMMs can also ask L2 for the first bytes of their weights before they
wait; that measured no gain (2.72-2.77 ms with 4 or 16 MiB, 2.99 with 48), so it is off.

KVRELAY_PDL: "1" (default) on where the GPU and Triton have it, "0" off.
KVRELAY_PDL_PREFETCH_MIB: how many MiB of a GEMM's weights its programs prefetch in all before
they wait (default 0: none).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from engine.env_flags import on_off

ENV = "KVRELAY_PDL"
PREFETCH_ENV = "KVRELAY_PDL_PREFETCH_MIB"
PREFETCH_MIB_DEFAULT = 0  # measured: no gain at 4 or 16 MiB, a loss at 48


@functools.cache
def wanted() -> bool:
    """KVRELAY_PDL allows PDL (read once; cache_clear to re-read); other values are refused."""
    return on_off(ENV, default=True)


@functools.cache
def prefetch_bytes() -> int:
    """The weight bytes a PDL GEMM's programs prefetch into L2 in all (read once)."""
    raw = os.environ.get(PREFETCH_ENV, str(PREFETCH_MIB_DEFAULT)).strip()
    if not raw.isdecimal() or int(raw) > 1024:
        raise ValueError(f"{PREFETCH_ENV} must be a whole number of MiB, 0..1024, got {raw!r}")
    return int(raw) << 20


@functools.cache
def _device_has_it(index: int) -> bool:
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        import triton.language as tl

        cuda = tl.extra.cuda
    except (ImportError, AttributeError):
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def enabled(device: torch.device) -> bool:
    """Whether the engine's Triton kernels on device launch with PDL: KVRELAY_PDL allows it,
    the device is a CUDA GPU of compute capability 9 or more, and Triton has the calls."""
    if device.type != "cuda" or not wanted():
        return False
    return _device_has_it(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def prefetch_then_wait() -> Any:
    """A @triton.jit helper for a GEMM program over BLOCK_N output channels of W [N, K] (1-byte
    elements, rows contiguous), prefetch_then_wait(w_ptr, pid, N, K, budget, BLOCK_N): ask L2
    for the first bytes of the program's rows of W (one contiguous slab; its share of budget
    bytes over all programs, in whole 128-byte lines, one line per lane at a time), then
    gdc_wait for the kernel before."""
    import triton
    import triton.language as tl

    @triton.jit
    def prefetch_then_wait(w_ptr, pid, N, K, budget, BLOCK_N: tl.constexpr):
        slab = (w_ptr + (pid * BLOCK_N).to(tl.int64) * K).to(tl.pointer_type(tl.int8))
        slab_bytes = tl.minimum(BLOCK_N, N - pid * BLOCK_N) * K
        num_lines = tl.minimum(slab_bytes, budget // tl.num_programs(0)) // 128
        lanes = tl.arange(0, 128)
        for first in range(0, num_lines, 128):
            line = tl.minimum(first + lanes, num_lines - 1).to(tl.int64)
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; // $0",
                "=r,l",
                [slab + line * 128],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        tl.extra.cuda.gdc_wait()

    return prefetch_then_wait
