"""Programmatic dependent launch (PDL) for the engine's Triton kernels on Hopper and newer:
whether they launch with it; owns no state but what it found of each device (imports triton on
first use).

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
(bench/RESULTS.md), so it is on wherever the GPU and Triton have it. (Asking L2 for the first
bytes of a GEMM's weights before its wait measured no gain: 2.72-2.77 ms with 4 or 16 MiB, 2.99
with 48.)
"""

from __future__ import annotations

import functools

import torch


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
    """Whether the engine's Triton kernels on device launch with PDL: the device is a CUDA GPU
    of compute capability 9 or more, and Triton has the calls."""
    if device.type != "cuda":
        return False
    return _device_has_it(torch.cuda.current_device() if device.index is None else device.index)
