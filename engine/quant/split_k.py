"""Split-K for the few-row FP8 products (fp8_dot_rows, fp8_one_row): each output tile's K range
is cut into SPLIT_K parts, one program a part; each stores its float32 partial sum in a
workspace and counts itself in, and the last to arrive sums the parts in order (so the result
does not depend on which came last) and writes the epilogue. Owns the per-device arrival
counters (zeroed once, put back to zero by each tile's last program, so a CUDA graph replays
them as it captured them) and the setting read once from the environment.

Why: at one to 16 rows these products are bound by reading the weight, and a narrow one (the 8B
shape's qkv, o and down: 4,096-6,144 channels in 32-channel tiles) makes only 128-192 programs
for the H200's 132 SMs, one program's few stages of loads in flight an SM: down read its
weight at ~2.4 TB/s where gate/up's 448 programs reached 3.9 (bench/RESULTS.md, issue 12's
eighteenth round). More programs a tile put more loads in flight.

KVRELAY_FP8_SPLIT_K=1 (off by default until measured in the engine): split_for's rule picks the
parts; bench.fused_gemv_bench --fp8 times fixed splits per projection. The split calls on one
device (and split_kv_decode's attention, which counts its parts on the same counters) must not
run concurrently: the engine runs a step's kernels on one stream.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.env_flags import on_off

ENV = "KVRELAY_FP8_SPLIT_K"
PROGRAMS_PER_SM = 4  # split_for's aim: about this many programs an SM
MIN_STEPS_PER_PART = 2  # split_for's parts: this many BLOCK_K steps at least (else all ramp)
COUNTER_SLOTS = 8192  # output tiles a split call may have (a 128k vocabulary at 16 a tile fits)
_counters: dict[torch.device, torch.Tensor] = {}


@functools.cache
def enabled() -> bool:
    """Whether the few-row FP8 products split K by split_for (read once; cache_clear to
    re-read)."""
    return on_off(ENV, False)


def split_for(num_tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """Parts of K for a product of num_tiles output tiles over K = k in block_k steps on a
    device of num_sms SMs: enough to make about PROGRAMS_PER_SM programs an SM, at least
    MIN_STEPS_PER_PART steps a part; 1 when enabled() is off."""
    if not enabled():
        return 1
    steps = -(-k // block_k)
    wanted = round(PROGRAMS_PER_SM * num_sms / max(num_tiles, 1))
    return max(1, min(wanted, steps // MIN_STEPS_PER_PART))


def num_sms(device: torch.device) -> int:
    """The device's SM count (the CPU's interpreter: 1)."""
    if device.type != "cuda":
        return 1
    return _cuda_sms(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The device's arrival counters (int32, COUNTER_SLOTS, all zero between calls), one for
    each of num_tiles (an output tile's, or split_kv_decode's row and KV head's) parts. Made on
    the first call, which must not be inside a CUDA graph's capture (the engine's eager warm-up
    steps come first)."""
    if num_tiles > COUNTER_SLOTS:
        raise ValueError(f"a split call takes at most {COUNTER_SLOTS} counters, got {num_tiles}")
    found = _counters.get(device)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the first split-K product on a device must run outside a graph")
        found = _counters[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return found


def launch_parts(
    split_k: int | None,
    num_tiles: int,
    k: int,
    block_k: int,
    part_shape: tuple[int, ...],
    unused: torch.Tensor,
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(split_k, workspace, counters) of a split kernel's launch: split_k (split_for's when
    None) checked; when it splits, a float32 workspace [split_k, *part_shape] and the device's
    counters, else `unused` for both (the kernel reads neither)."""
    device = unused.device
    if split_k is None:
        split_k = split_for(num_tiles, k, block_k, num_sms(device))
    split_k = checked_split(split_k, k, block_k)
    if split_k == 1:
        return 1, unused, unused
    workspace = torch.empty((split_k, *part_shape), dtype=torch.float32, device=device)
    return split_k, workspace, counters(device, num_tiles)


def checked_split(split_k: int, k: int, block_k: int) -> int:
    """split_k after checking it: 1, or up to the number of BLOCK_K steps (no part empty)."""
    steps = -(-k // block_k)
    if split_k != 1 and not 1 <= split_k <= steps:
        raise ValueError(f"split_k must be 1..{steps} for K={k} in steps of {block_k}")
    return split_k


def __getattr__(name: str) -> Any:
    """The @triton.jit helpers of split_k_jit.py, imported on first use (so that importing this
    module does not import triton): kernels call them as split_k.part_bounds(...) and
    split_k.sum_parts(...), through the module, which Triton's interpreter resolves too (it sees
    no closures)."""
    if name not in ("part_bounds", "sum_parts"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from engine.quant import split_k_jit

    return getattr(split_k_jit, name)
